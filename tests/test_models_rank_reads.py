"""Every rank reads only its own tensors from a checkpoint, on every loading path.

Two gloo ranks build their part of a checkpoint (sharded safetensors) with config overrides and a
vocabulary that grows (mean rows) or is swapped (rows gathered by a RowMap). `models.weights.open_safetensors` is
wrapped to count the bytes each rank reads; the count must equal exactly what the rank holds plus its
share of the mean: its decoder layers, the source rows of its vocabulary shard, and 1/2 of the vocabulary
matrices for the collective mean. The whole checkpoint is about twice that.
"""

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_config
from vp_accelerate.distributed import spawn


class _Counted:
    """An open_safetensors handle that adds the bytes of every tensor it returns to `counter`."""

    def __init__(self, handle, counter):
        self.h, self.counter = handle, counter

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.h.__exit__(*exc)

    def keys(self):
        return self.h.keys()

    def get_tensor(self, name):
        t = self.h.get_tensor(name)
        self.counter[name] = self.counter.get(name, 0) + t.numel() * t.element_size()
        return t

    def get_slice(self, name):
        sl, counter = self.h.get_slice(name), self.counter

        class Slice:
            def __getitem__(self, key):
                t = sl[key]
                counter[name] = counter.get(name, 0) + t.numel() * t.element_size()
                return t

            def get_shape(self):
                return sl.get_shape()

        return Slice()


def _rank_reads(path, cases):
    """On each rank: build every case reading through a counting open_safetensors; return bytes read per case."""
    from vp_accelerate.models import StageLayout, build_rank, weights
    from vp_accelerate.models.checkpoint_source import CheckpointSource, share_vocab_means
    from vp_accelerate.models.row_map import RowMap
    from vp_accelerate.vocab.partition import VocabPartition

    rank, world = dist.get_rank(), dist.get_world_size()
    real_open = weights.open_safetensors  # what every SafetensorsSource opens its files with
    out = {}
    for name, overrides, vocab, sources in cases:
        counter: dict[str, int] = {}
        weights.open_safetensors = lambda *a, **k: _Counted(real_open(*a, **k), counter)
        try:
            row_map = None
            if sources is not None:
                row_map = RowMap.from_lists(
                    [list(s) for s in sources], 97, [0 if not s else 1 if len(s) == 1 else 2 for s in sources]
                )
            src = CheckpointSource.from_dir(path, overrides, vocab, row_map)
            share_vocab_means(src, rank, world, dist.all_reduce)
            layout = StageLayout.one_per_rank(src.config.num_hidden_layers, world)
            part = VocabPartition(src.config.vocab_size, world)
            rm = build_rank(src, layout, rank, "vocab", part)
        finally:
            weights.open_safetensors = real_open
        out[name] = (counter, part.shard_range(rank), {n: t.clone() for n, t in rm.state_dict().items()})
    return out


def test_each_rank_reads_only_its_tensors(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", vocab_size=97, hidden_size=32, num_layers=4, tie=False)
    )
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")  # several files
    rng = np.random.default_rng()
    swap = [tuple(rng.choice(97, size=int(rng.integers(0, 4)), replace=False).tolist()) for _ in range(131)]
    cases = [
        ("resize+overrides", {"rms_norm_eps": 1e-3, "num_hidden_layers": 4}, 97 + 29, None),
        ("swap", {}, 131, swap),
        ("keep", {"rope_theta": 5e4}, None, None),
    ]
    results = spawn(_rank_reads, 2, str(tmp_path / "ckpt"), cases, timeout_s=180)

    sd = model.state_dict()
    h, row = 32, 32 * 4
    for rank, res in enumerate(results):
        own_layers = {n for n in sd if n.startswith(tuple(f"model.layers.{i}." for i in (2 * rank, 2 * rank + 1)))}
        if rank == 1:
            own_layers.add("model.norm.weight")
        layer_bytes = sum(sd[n].numel() * 4 for n in own_layers)
        for name, overrides, vocab, sources in cases:
            counter, (start, end), state = res[name]
            V = vocab or 97
            end = min(end, V)
            if sources is None:
                rows_needed = max(0, min(end, 97) - start)
                mean_rows = 97 * rank // 2, 97 * (rank + 1) // 2
                mean_bytes = (mean_rows[1] - mean_rows[0]) * row if V > 97 else 0
            else:
                rows_needed = len({j for i in range(start, end) for j in sources[i]})
                mean_bytes = (97 * (rank + 1) // 2 - 97 * rank // 2) * row if any(not s for s in sources) else 0
            per_matrix = rows_needed * row + mean_bytes
            assert set(counter) == own_layers | {"model.embed_tokens.weight", "lm_head.weight"}, (name, rank)
            assert sum(counter[n] for n in own_layers) == layer_bytes, (name, rank)
            assert counter["model.embed_tokens.weight"] == counter["lm_head.weight"] == per_matrix, (name, rank)
            total = sum(t.numel() * 4 for t in sd.values())
            assert sum(counter.values()) < 0.7 * total, (name, rank)
        # what was read is right: kept rows equal the checkpoint's, grown rows its mean
        _, (start, end), state = res["resize+overrides"]
        emb = state["model.embed_tokens.weight"]
        n_old = max(0, min(end, 97) - start)
        assert torch.equal(emb[:n_old], sd["model.embed_tokens.weight"][start : start + n_old])
        if end > 97:
            torch.testing.assert_close(
                emb[97 - start : min(end, 126) - start],
                sd["model.embed_tokens.weight"].mean(0).expand(min(end, 126) - 97, h),
                rtol=0,
                atol=1e-6,
            )
        _, (start, end), state = res["swap"]
        head = state["lm_head.weight"]
        for i in range(start, min(end, 131)):
            want = sd["lm_head.weight"][list(swap[i])].mean(0) if swap[i] else sd["lm_head.weight"].mean(0)
            torch.testing.assert_close(head[i - start], want, rtol=0, atol=1e-6)
