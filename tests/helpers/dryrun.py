"""A dry run of a tiny world that also keeps each run rank's recorded program (its communicators' operations in
order), for the tests that compare programs across ranks or look for a collective."""

from __future__ import annotations

from helpers.tiny import tiny_llama
from vp_accelerate.dryrun.world import dry_run_world


def world_with_programs(cfg, world_size: int, vocab: int = 257, layers: int = 4, **kwargs):
    """(WorldResult, {rank: program}) of `dry_run_world` on a tiny Llama, global batch 16, seq 16 unless given."""
    import vp_accelerate.dryrun.world as w

    programs = {}
    real = w.run_rank

    def keep(*args, **kw):
        mem, program = real(*args, **kw)
        programs[mem.rank] = program
        return mem, program

    w.run_rank = keep
    try:
        kwargs = {"global_batch": 16, "seq": 16} | kwargs
        result = dry_run_world(tiny_llama(vocab, num_layers=layers), cfg, world_size, **kwargs)
    finally:
        w.run_rank = real
    return result, programs
