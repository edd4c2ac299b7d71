"""No host synchronisation inside a training step: on a GPU every `Tensor.__bool__`,
`.item()`, `.tolist()`, `.nonzero()`, `.cpu()`, `int()` / `float()` of a device tensor stalls the host until
the device catches up, and the pipeline's overlap is gone. On gloo ranks the test counts those calls inside
`train_step`, for every schedule x method, on plain, packed (position_ids restart), padded and all-ones-mask
batches, and allows only the loss read (`finish_loss`) and fp16's found-inf flag (`unscale_and_check`).

What runs on host data by design is left out: the batch checks and the host decisions of
`make_microbatches` (the caller's batch is on the host), the masks built on the host once per microbatch
(`models.masks`), and `bubble_rate` (a timing summed on the gloo side group)."""

from __future__ import annotations

import sys

import torch

from vp_accelerate.distributed import spawn
from vp_accelerate.schedule.registry import supported_pairs

READS = ("__bool__", "item", "tolist", "nonzero", "cpu", "__int__", "__float__")
ALLOWED = {("finish_loss", "item"): 1}
ALLOWED_FP16 = {("finish_loss", "item"): 1, ("unscale_and_check", "item"): 1}


class _Counter:
    """Counts host reads of tensors per (calling function, read) while active and outside a host section."""

    def __init__(self):
        self.active, self.host, self.calls = False, 0, {}
        self.originals = {name: getattr(torch.Tensor, name) for name in READS}

    def install(self):
        for name, real in self.originals.items():
            setattr(torch.Tensor, name, self._wrap(name, real))

    def uninstall(self):
        for name, real in self.originals.items():
            setattr(torch.Tensor, name, real)

    def _wrap(self, name, real):
        counter = self

        def read(t, *a, **k):
            if counter.active and not counter.host:
                key = (sys._getframe(1).f_code.co_name, name)
                counter.calls[key] = counter.calls.get(key, 0) + 1
            return real(t, *a, **k)

        return read

    def host_section(self, fn):
        counter = self

        def run(*a, **k):
            counter.host += 1
            try:
                return fn(*a, **k)
            finally:
                counter.host -= 1

        return run


def _batches(seed: int, b: int = 4, s: int = 12, vocab: int = 101) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    packed = torch.arange(s).repeat(b, 1)
    packed[:, 5:] -= 5  # a second document starts at position 5 of every row
    padded = torch.ones(b, s, dtype=torch.long)
    padded[::2, -3:] = 0  # right padding on every other row
    return {
        "plain": (ids, ids, None, None),
        "explicit default positions, all-ones mask": (
            ids,
            ids,
            torch.ones(b, s, dtype=torch.long),
            torch.arange(s).repeat(b, 1),
        ),
        "packed": (ids, ids, None, packed),
        "padded": (ids, ids, padded, None),
    }


def _count_reads():
    from helpers.tiny import tiny_config, tiny_llama
    from vp_accelerate.models import masks
    from vp_accelerate.runtime import PipelineConfig, PipelineModel, pipeline

    counter = _Counter()
    real = (pipeline.make_microbatches, pipeline.bubble_rate, masks.build_on_host)
    pipeline.make_microbatches = counter.host_section(pipeline.make_microbatches)
    pipeline.bubble_rate = counter.host_section(pipeline.bubble_rate)
    masks.build_on_host = counter.host_section(masks.build_on_host)
    out = {}
    llama = tiny_llama(101, num_layers=4)
    mistral = tiny_config("mistral", vocab_size=101)  # sliding-window layers: another mask builder
    runs = [(kind, method, "no", llama) for kind, method in supported_pairs()]
    runs += [("1f1b", "vocab-2", "fp16", llama), ("vhalf", "vocab-1", "no", mistral)]
    counter.install()
    try:
        for kind, method, precision, model in runs:
            cfg = PipelineConfig(schedule=kind, method=method, microbatches=2, mixed_precision=precision)
            pipe = PipelineModel(model, cfg)
            for name, batch in _batches(seed=len(out)).items():
                counter.calls = {}
                counter.active = True
                try:
                    pipe.train_step(*batch)
                finally:
                    counter.active = False
                out[(kind, method, precision, model.model_type, name)] = dict(counter.calls)
                pipe.zero_grad()
            pipe.close()
    finally:
        counter.uninstall()
        pipeline.make_microbatches, pipeline.bubble_rate, masks.build_on_host = real
    return out


def test_a_training_step_reads_the_device_only_for_the_loss_and_fp16_found_inf():
    per_rank = spawn(_count_reads, 2, timeout_s=300)
    for reads in per_rank:
        assert len(reads) == 4 * (len(supported_pairs()) + 2)
        bad = {k: v for k, v in reads.items() if v != (ALLOWED_FP16 if k[2] == "fp16" else ALLOWED)}
        assert not bad, bad
