"""The dry run of tensor-parallel layouts: TP rank 0 of each stage runs, its stage's other TP ranks and the other
replicas are derived (`tp_program`, `replica_program`) and checked against ranks run for real; the TP collectives
are recorded and replayed with the world's; the planner's TP memory against the dry run per rank; bad TP input in
one line with exit 2. (Before: `dryrun` refused TP recipes; the TP all-gathers and reduce-scatters were not
recorded; ZeRO-1 at tp > 1 broadcast from the wrong ranks, which running replica 1's TP rank 1 found.)"""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers.dryrun import world_with_programs
from helpers.tiny import tiny_llama
from vp_accelerate.dryrun.run import replica_program, run_rank, tp_program
from vp_accelerate.dryrun.world import dry_run_world
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.schedule.world import replay_world

PP, TP, DP = 2, 2, 2
CFG = PipelineConfig(
    schedule="1f1b", method="vocab-2", microbatches=4, pp_size=PP, tp_size=TP, dp_size=DP, mixed_precision="bf16"
)


@pytest.fixture(scope="module")
def world8():
    return world_with_programs(CFG, PP * TP * DP)


def test_tp_rank_0_of_each_stage_runs_and_the_world_with_its_tp_collectives_finishes(world8):
    result, programs = world8
    assert [m.rank for m in result.ranks] == [0, 2] and result.deadlock is None
    kinds = {(o.comm.split("#")[0], o.kind) for o in programs[2]}
    assert ("dev:(2, 3)", "all_gather_into_tensor") in kinds  # the sequence all-gather of stage 1's TP group
    assert ("dev:(2, 3)", "reduce_scatter_tensor") in kinds
    assert ("dev:(0, 2)", "batch_isend_irecv") in kinds  # TP rank 0's pipeline
    assert ("dev:(2, 6)", "broadcast") in kinds  # ZeRO-1 over the (pp 1, tp 0) coordinate's replicas
    # 8 ranks x their programs
    assert result.ops == sum(len(programs[s * TP]) for s in range(PP)) * TP * DP
    # a TP rank that skips one of its layer's collectives never finishes
    world = {r: _derived(programs, r) for r in range(PP * TP * DP)}
    i = next(i for i, o in enumerate(world[3]) if o.kind == "reduce_scatter_tensor")
    world[3] = world[3][:i] + world[3][i + 1 :]
    assert replay_world(world) is not None


def _derived(programs, r: int):
    block = PP * TP
    d, s, t = r // block, (r % block) // TP, r % TP
    prog = programs[s * TP]
    return replica_program(tp_program(prog, TP, t) if t else prog, block, d)


@pytest.mark.parametrize("rank", [pytest.param(1, marks=pytest.mark.slow), 7])  # rank 7 moves groups, roots, peers
def test_a_tp_rank_run_for_real_issues_the_derived_program(world8, rank):
    """TP rank 1 of stage 0 (rank 1), and of stage 1 in replica 1 (rank 7), run for real: their programs equal the
    derived ones (groups, roots, p2p peers, bucket identities), their memory TP rank 0's."""
    result, programs = world8
    mem, program = run_rank(tiny_llama(257, num_layers=4), CFG, rank, PP * TP * DP, 16 // DP, 16)
    assert program == _derived(programs, rank)
    stage = (rank % (PP * TP)) // TP
    assert mem.param_bytes == result.ranks[stage].param_bytes
    # replica 1 owns its own ZeRO-1 share (the optimizer step's buckets): within a parameter's bytes of replica 0's
    same = 0 if rank < PP * TP else 0.01
    assert mem.activation_peak_bytes == pytest.approx(result.ranks[stage].activation_peak_bytes, rel=same)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,method,ckpt", [("1f1b", "vocab-2", "none"), ("vhalf", "vocab-1", "none"), ("1f1b", "vocab-2", "full")]
)
def test_the_planners_tp_memory_agrees_with_the_dry_run(schedule, method, ckpt):
    """The planner's memory of a pp 2 x tp 2 layout (sequence parallelism on) against the dry run's allocator count,
    per rank, on the 22M-parameter Llama of tests/test_dryrun.py at seq 512: within 7% both ways (measured: -4.0% ..
    +6.1%; the same layouts at tp 1: +0.9% .. +5.7%, rank 0's over-count of a checkpointed first layer's input is
    tp 1's)."""
    from transformers import AutoConfig

    from vp_accelerate.cost import GPU_PRESETS
    from vp_accelerate.dryrun.world import planned_bytes
    from vp_accelerate.sim.plan import PlanRequest

    conf = dict(model_type="llama", vocab_size=32003, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip
    seq, batch = 512, 8
    cfg = PipelineConfig(
        schedule=schedule, method=method, microbatches=4, pp_size=2, tp_size=2, mixed_precision="bf16",
        attn_implementation="sdpa", activation_checkpointing=ckpt, zero=0,
    )  # fmt: skip
    result = dry_run_world(AutoConfig.for_model(**conf), cfg, 4, batch, seq)
    assert result.deadlock is None
    req = PlanRequest(gpus=4, memory_gb=80.0, seq=seq, global_batch=batch, hardware=GPU_PRESETS["h100"][0])
    for mem, planned in zip(result.ranks, planned_bytes(conf, req, cfg)):
        assert planned == pytest.approx(mem.peak_bytes, rel=0.07), (mem.rank, planned, mem.peak_bytes)


@pytest.mark.parametrize(
    "extra,said",
    [
        (["--tp", "2", "--method", "interlaced"], "method interlaced"),  # not split over TP yet
        (["--tp", "3", "--method", "vocab-2"], "does not divide --world-size"),
        (["--tp", "2", "--method", "vocab-2", "--gpus-per-node", "1"], "must share a node"),
        (["--tp", "4", "--method", "vocab-2", "--world-size", "8"], "key/value heads"),  # 2 kv heads
        (["--tp", "2", "--method", "vocab-2", "--seq", "9"], "--seq 9"),  # sequence parallelism splits it
    ],
)
def test_bad_tp_input_is_one_line_and_exit_2(tmp_path, capsys, extra, said):
    from vp_accelerate.train.cli.dryrun import dryrun_main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(_Tiny())))
    args = [str(path), "--world-size", "4", "--seq", "8", "--global-batch", "4", "--pp", "1"]
    args += ["--schedule", "1f1b", "--microbatches", "2"]
    assert dryrun_main(args + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


@dataclasses.dataclass
class _Tiny:
    model_type: str = "llama"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 64


def test_the_command_runs_a_tp_layout_and_says_which_ranks_ran(tmp_path, capsys):
    from vp_accelerate.train.cli.dryrun import dryrun_main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(_Tiny())))
    args = [str(path), "--world-size", "4", "--seq", "8", "--global-batch", "4", "--pp", "1", "--tp", "2"]
    args += ["--schedule", "1f1b", "--method", "vocab-2", "--microbatches", "2", "--json"]
    assert dryrun_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ran"] == [0] and not out["deadlock"]
    assert [r["replicas"] for r in out["ranks"]] == [[0, 1, 2, 3]]  # its TP rank and the other replica's, derived
    assert out["layout"]["tp_size"] == 2 and all(r["planned_bytes"] > 0 for r in out["ranks"])
