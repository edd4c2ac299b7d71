"""Checkpoints reshard (train/persist/reshard.py): a checkpoint saved by one layout loads into another — pipeline
size, data-parallel size with ZeRO-1, schedule — with exactly the same global weights and AdamW moments (every
element, vocabulary shards compared as rows of the full matrix), and training goes on as the saved layout's
own uninterrupted run (float64, so the layouts' different summation orders stay far below the check).

Cases: 1f1b -> vhalf on 2 ranks; pp 2 -> pp 4; pp 2 x dp 2 (ZeRO-1) -> pp 4; pp 2 x dp 2 without ZeRO (the
replicas save no second copy of weights or optimizer state) -> with ZeRO-1."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_config, tiny_llama
from vp_accelerate.distributed import spawn

VOCAB = 101
BEFORE, AFTER = 2, 2  # steps saved, then steps after the resume


def _batches(seed: int, n: int, rows: int = 8, seq: int = 8):
    g = torch.Generator().manual_seed(seed)
    return [(ids := torch.randint(0, VOCAB, (rows, seq), generator=g), ids.clone()) for _ in range(n)]


def _pipe(ckpt, schedule, dp_size, zero=1, tp_size=1, pp_size=None, method="vocab-2", adapter=None):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.adapter_config import AdapterConfig
    from vp_accelerate.train.recipe import OptimizerSection
    from vp_accelerate.train.run.optim import build_optimizer

    pipe = PipelineModel(
        ckpt,
        PipelineConfig(
            schedule=schedule,
            method=method,
            microbatches=4,
            dp_size=dp_size,
            tp_size=tp_size,
            pp_size=pp_size,
            attn_implementation="eager",
        ),
        dtype=torch.float64,
        adapter=AdapterConfig(**adapter) if adapter else None,
    )
    opt = build_optimizer(pipe, OptimizerSection(lr=1e-2, eps=1e-4, weight_decay=0.1, betas=[0.9, 0.99]))
    return pipe, opt


def _train(pipe, opt, batches):
    losses = []
    for ids, labels in batches:
        rows = ids.shape[0] // pipe.dp_size
        sl = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
        losses.append(pipe.train_step(ids[sl], labels[sl]).loss)
        pipe.clip_grad_norm_(1.0)
        pipe.step(opt)
        pipe.zero_grad()
    return losses


def _global_state(pipe, opt):
    """Every weight and moment by global name, vocabulary shards joined and cut to the vocabulary (replica 0's
    pipeline ranks; ZeRO's moments from the replica that owns them)."""
    from vp_accelerate.models.tensor_parallel import join_packed
    from vp_accelerate.train.persist.reshard import named_optimizer_state

    mine = {n: t.detach().clone() for n, t in pipe.mods.state_dict().items()}
    moments = {
        f"{n}/{k}": v
        for n, s in named_optimizer_state(opt, pipe.named_parameters())["state"].items()
        for k, v in s.items()
    }
    parts = [None] * dist.get_world_size()
    g = pipe.groups
    mine = (
        g.vocab_rank,
        pipe.dp_rank,
        mine,
        moments,
        sorted(pipe.mods.sharded_names),
        pipe.mods.tp_sliced,
        pipe.mods.tp_packed,
        pipe.mods.tp_vocab_names,
    )
    dist.all_gather_object(parts, mine)
    sliced = {n: d for part in parts for n, d in part[5].items()}
    packed = {n: p for part in parts for n, p in part[6].items()}
    tp_vocab = {n for part in parts for n in part[7]}  # the baseline's end layers split over TP: padded rows
    full = {}
    for vr, dp, weights, moms, *_ in sorted(parts, key=lambda x: (x[0], x[1])):
        sharded = set(parts[0][4])
        for kind, tensors in (("w", weights), ("m", moms)):
            if kind == "w" and dp > 0:
                continue
            for name, t in tensors.items():
                key, base = (kind, name), name.split("/")[0]
                if (base in sharded or base in sliced) and t.dim() > 0:
                    if dp == 0 or kind == "m":
                        full.setdefault(key, {})[vr] = t
                else:
                    full.setdefault(key, t)
    out = {}
    for key, value in full.items():
        if not isinstance(value, dict):
            out[key] = value
            continue
        pieces = [value[vr] for vr in sorted(value)]  # vocabulary-rank order: a stage's TP ranks in order
        base = key[1].split("/")[0]
        if base in packed:
            out[key] = join_packed(pieces, packed[base])
        else:
            out[key] = torch.cat(pieces, sliced[base]) if base in sliced else torch.cat(pieces)[:VOCAB]
            out[key] = out[key][:VOCAB] if base in tp_vocab else out[key]
    return out


def _save(pipe, opt, path, step):
    from vp_accelerate.train.persist import store as ckpt
    from vp_accelerate.train.persist.reshard import rank_model_state, rank_optimizer_state

    # as the trainer saves (run/state_parts.py)
    model_state, optimizer_state = rank_model_state(pipe), rank_optimizer_state(pipe, opt)
    ranks, sliced = [None] * dist.get_world_size(), [None] * dist.get_world_size()
    g = pipe.groups
    dist.all_gather_object(
        ranks, {"rank": pipe.rank, "pp_rank": pipe.pp_rank, "dp_rank": pipe.dp_rank, "tp_rank": g.tp_rank}
    )
    dist.all_gather_object(sliced, (pipe.mods.tp_sliced, pipe.mods.tp_packed, pipe.mods.tp_vocab_names))
    meta = {
        "ranks": ranks,
        "vocab_size": VOCAB,
        "sharded_names": sorted(pipe.mods.sharded_names),
        "fingerprint": {},
        "tp_size": g.tp_size,  # as run_state.save_run writes them
        "tp_sliced": {n: d for part, _, _ in sliced for n, d in part.items()},
        "tp_packed": {n: p for _, part, _ in sliced for n, p in part.items()},
        "tp_vocab": sorted({n for *_, part in sliced for n in part}),
    }
    return ckpt.save_checkpoint(
        ckpt.SaveSpec(path, step, pipe.rank),
        ckpt.RankState(model_state, optimizer_state, {"step": step}, meta),
        dist.barrier,
    )


def _resume(pipe, opt, path):
    from vp_accelerate.train.persist import store as ckpt
    from vp_accelerate.train.persist.reshard import (
        load_named_optimizer_state,
        reshard_model,
        reshard_optimizer_state,
    )

    meta = ckpt.read_meta(path)
    reshard_model(pipe, path, meta)
    state = reshard_optimizer_state(pipe, path, meta)
    load_named_optimizer_state(opt, pipe.named_parameters(), state, same_groups=False)


def _saving_run(ckpt, batches, schedule, dp_size, path, zero=1, tp_size=1, method="vocab-2", adapter=None):
    """The saved layout: BEFORE steps, a checkpoint, then AFTER more steps uninterrupted (the reference)."""
    pipe, opt = _pipe(ckpt, schedule, dp_size, zero, tp_size, method=method, adapter=adapter)
    _train(pipe, opt, batches[:BEFORE])
    saved = _global_state(pipe, opt)
    step_dir = _save(pipe, opt, path, BEFORE)
    losses = _train(pipe, opt, batches[BEFORE:])
    after = _global_state(pipe, opt)
    pipe.close()
    return step_dir, saved, losses, after


def _resuming_run(ckpt, batches, schedule, dp_size, step_dir, tp_size=1, pp_size=None, method="vocab-2", adapter=None):
    pipe, opt = _pipe(ckpt, schedule, dp_size, tp_size=tp_size, pp_size=pp_size, method=method, adapter=adapter)
    _resume(pipe, opt, step_dir)
    loaded = _global_state(pipe, opt)
    losses = _train(pipe, opt, batches[BEFORE:])
    after = _global_state(pipe, opt)
    pipe.close()
    return loaded, losses, after


def _two_ranks(ckpt, batches, out):
    step_dir, saved, losses, after = _saving_run(ckpt, batches, "1f1b", 1, f"{out}/pp2")
    return step_dir, saved, losses, after, _resuming_run(ckpt, batches, "vhalf", 1, step_dir)


def _four_ranks(ckpt, batches, out, pp2_dir):
    step_dir, saved, losses, after = _saving_run(ckpt, batches, "1f1b", 2, f"{out}/pp2dp2")
    plain_dir, *plain = _saving_run(ckpt, batches, "1f1b", 2, f"{out}/pp2dp2_zero0", zero=0)
    return (
        (saved, losses, after),
        _resuming_run(ckpt, batches, "1f1b", 1, pp2_dir),
        _resuming_run(ckpt, batches, "1f1b", 1, step_dir),
        plain,
        _resuming_run(ckpt, batches, "1f1b", 2, plain_dir),  # zero 0 -> zero 1 on the same ranks
    )


def _same_state(loaded, saved, case):
    assert set(loaded) == set(saved), (case, set(loaded) ^ set(saved))
    for key, t in saved.items():
        assert torch.equal(loaded[key], t), (case, key)


def _same_training(resumed, reference, case):
    (_, losses, after), (ref_losses, ref_after) = resumed, reference
    assert losses == pytest.approx(ref_losses, rel=1e-10), case
    for key, t in ref_after.items():
        torch.testing.assert_close(after[key], t, rtol=1e-9, atol=1e-12, msg=lambda m: f"{case} {key}: {m}")


def test_resharding_resumes(tmp_path):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    ckpt = str(tmp_path / "hf")
    AutoModelForCausalLM.from_config(tiny_llama(VOCAB, tied=False, num_layers=4)).save_pretrained(ckpt)
    batches = _batches(seed, BEFORE + AFTER)
    two = spawn(_two_ranks, 2, ckpt, batches, str(tmp_path), timeout_s=300)[0]
    step_dir, saved, losses, after, to_vhalf = two
    _same_state(to_vhalf[0], saved, ("1f1b -> vhalf", seed))
    _same_training(to_vhalf, (losses, after), ("1f1b -> vhalf", seed))
    four = spawn(_four_ranks, 4, ckpt, batches, str(tmp_path), step_dir, timeout_s=300)[0]
    (saved4, losses4, after4), pp4_from_pp2, pp4_from_dp2, (saved0, losses0, after0), zero1_from_zero0 = four
    _same_state(pp4_from_pp2[0], saved, ("pp2 -> pp4", seed))
    _same_training(pp4_from_pp2, (losses, after), ("pp2 -> pp4", seed))
    _same_state(pp4_from_dp2[0], saved4, ("pp2 x dp2 -> pp4", seed))
    _same_training(pp4_from_dp2, (losses4, after4), ("pp2 x dp2 -> pp4", seed))
    _same_state(zero1_from_zero0[0], saved0, ("zero 0 -> zero 1", seed))  # replica 1 wrote no second copy
    _same_training(zero1_from_zero0, (losses0, after0), ("zero 0 -> zero 1", seed))


def _tp_four_ranks(ckpt, batches, out, method="vocab-2", adapter=None):
    kw = dict(method=method, adapter=adapter)
    step_dir, saved, losses, after = _saving_run(ckpt, batches, "1f1b", 1, f"{out}/pp2tp2", tp_size=2, **kw)
    return step_dir, saved, losses, after, _resuming_run(ckpt, batches, "1f1b", 1, step_dir, **kw)  # pp 4


def _tp_two_ranks(ckpt, batches, step_dir, method="vocab-2", other="vocab-2", adapter=None):
    return (
        _resuming_run(ckpt, batches, "1f1b", 1, step_dir, method=other, adapter=adapter),  # pp 2, tp 1
        _resuming_run(ckpt, batches, "1f1b", 1, step_dir, tp_size=2, pp_size=1, method=method, adapter=adapter),
    )


@pytest.mark.parametrize("family", ["llama", pytest.param("phi3", marks=pytest.mark.slow)])
def test_tensor_parallel_checkpoints_reshard_across_tp(tmp_path, family):
    """pp 2 x tp 2 -> pp 4 (tp 1), -> pp 2 (tp 1) and -> pp 1 x tp 2: every weight and moment equal, joined
    along its slice's dim (Phi-3's fused qkv / gate_up one part at a time), and training goes on as the saved
    layout's (before: a TP slice was read as a whole tensor)."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    ckpt = str(tmp_path / "hf")
    config = tiny_llama(VOCAB, tied=False, num_layers=4) if family == "llama" else tiny_config(family, vocab_size=VOCAB)
    AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    batches = _batches(seed, BEFORE + AFTER)
    step_dir, saved, losses, after, pp4 = spawn(_tp_four_ranks, 4, ckpt, batches, str(tmp_path), timeout_s=300)[0]
    pp2, tp2 = spawn(_tp_two_ranks, 2, ckpt, batches, step_dir, timeout_s=300)[0]
    for case, resumed in (("pp2 x tp2 -> pp4", pp4), ("-> pp2", pp2), ("-> pp1 x tp2", tp2)):
        _same_state(resumed[0], saved, (case, seed))
        _same_training(resumed, (losses, after), (case, seed))


@pytest.mark.slow
def test_baseline_end_layers_split_over_tp_reshard(tmp_path):
    """Method baseline at pp 2 x tp 2 (the embedding and the output layer split by rows over the end stages' TP
    ranks, 51 + 50 rows and a padding row) -> pp 4 baseline (whole matrices), -> pp 2 vocab-2 (shards over pp),
    -> pp 1 x tp 2 baseline (both matrices on each TP rank): every weight and moment equal, the padding dropped,
    and training goes on as the saved layout's (before: tp_size 2 refused the baseline)."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    ckpt = str(tmp_path / "hf")
    AutoModelForCausalLM.from_config(tiny_llama(VOCAB, tied=False, num_layers=4)).save_pretrained(ckpt)
    batches = _batches(seed, BEFORE + AFTER)
    out = spawn(_tp_four_ranks, 4, ckpt, batches, str(tmp_path), "baseline", timeout_s=300)[0]
    step_dir, saved, losses, after, pp4 = out
    pp2, tp2 = spawn(_tp_two_ranks, 2, ckpt, batches, step_dir, "baseline", "vocab-2", timeout_s=300)[0]
    for case, resumed in (("pp2 x tp2 -> pp4", pp4), ("-> pp2 vocab-2", pp2), ("-> pp1 x tp2", tp2)):
        _same_state(resumed[0], saved, (case, seed))
        _same_training(resumed, (losses, after), (case, seed))


@pytest.mark.slow
def test_lora_on_tp_slices_reshards(tmp_path):
    """LoRA at pp 2 x tp 2 (adapters of column- and row-split layers, their frozen split bases) -> pp 4, pp 2 and
    pp 1 x tp 2: every weight and moment equal, and training goes on as the saved layout's (before: LoRA under
    tp_size 2 was refused)."""
    pytest.importorskip("peft")
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    ckpt = str(tmp_path / "hf")
    AutoModelForCausalLM.from_config(tiny_llama(VOCAB, tied=False, num_layers=4)).save_pretrained(ckpt)
    batches = _batches(seed, BEFORE + AFTER)
    adapter = dict(type="lora", r=4, alpha=8, target_modules=["q_proj", "o_proj", "up_proj", "down_proj"])
    out = spawn(_tp_four_ranks, 4, ckpt, batches, str(tmp_path), "vocab-2", adapter, timeout_s=300)[0]
    step_dir, saved, losses, after, pp4 = out
    pp2, tp2 = spawn(_tp_two_ranks, 2, ckpt, batches, step_dir, "vocab-2", "vocab-2", adapter, timeout_s=300)[0]
    assert any(".lora_A." in name for _, name in saved)
    for case, resumed in (("pp2 x tp2 -> pp4", pp4), ("-> pp2", pp2), ("-> pp1 x tp2", tp2)):
        _same_state(resumed[0], saved, (case, seed))
        _same_training(resumed, (losses, after), (case, seed))
