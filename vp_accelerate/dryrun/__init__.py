"""The dry run: the real runtime of every distinct rank of a layout on one CPU, with fake tensors and a fake
process group (`fake_world.py`), its per-rank memory (`run.py`) and the whole world's communication replayed
under NCCL's rules (`world.py`, with `schedule/world.py`'s replay). `vp-accelerate dryrun` is its command (train/cli/dryrun.py)."""


class FakeWorldMissing(ImportError):
    """This torch has no fake process group (`torch.testing._internal.distributed.fake_pg`, a private module:
    a trimmed build, or a release that moved it); the dry run cannot run."""
