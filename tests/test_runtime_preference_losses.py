"""TRL's other preference losses are exact under vocabulary parallelism: loss lists with weights (RPO's
[sigmoid, sft]), robust, apo_zero, SimPO, ORPO's [sft, orpo] and KTO (kto, apo_zero_unpaired), on 2 ranks.

The reference is TRL 1.16's own code, called on the single-process HF model's float64 log-probabilities:
`DPOTrainer._compute_loss` and `KTOTrainer._compute_loss` with a stand-in for the fused head that returns the
model's per-token log-probabilities (so TRL's masking, chunking, token means and KL clamp run as written),
`CPOTrainer.cpo_loss` (SimPO) on the length-normalised log-probabilities; ORPO's `odds_ratio_loss` casts to
float32, so its float64 reference is its formula over TRL's own `log1mexp`, itself checked against
`odds_ratio_loss` to float32 precision. The loss and every gradient (gathered into HF names) must agree to
1e-9 on 1F1B with vocab-2 (and, marked slow, V-Half on the baseline). Fails on the code before these losses (DPO, IPO, hinge only).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn

trl = pytest.importorskip("trl")
from trl import DPOTrainer, KTOTrainer  # noqa: E402
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.experimental.orpo.orpo_trainer import log1mexp  # noqa: E402

from helpers.grads import gathered_grads as _gathered_grads  # noqa: E402
from helpers.trl_stub import trainer_self  # noqa: E402

SEQ = 10
BETA = 0.3
PAIRED = {  # name: Preference keyword arguments
    "rpo": dict(loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.7)),
    "robust": dict(loss_type="robust", label_smoothing=0.2),
    "apo_zero": dict(loss_type="apo_zero"),
    "simpo": dict(loss_type="simpo", label_smoothing=0.1, simpo_gamma=0.4),
    "orpo": dict(loss_type=("sft", "orpo")),
}
UNPAIRED = {
    "kto": dict(loss_type="kto", desirable_weight=1.3, undesirable_weight=0.8),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired"),
}
FAST = [("1f1b", "vocab-2")]
SLOW = [("vhalf", "baseline")]  # the baseline's g on its autograd CE, with V-Half's split backward


def _rows(seed: int, vocab: int, rows: int):
    """Rows 2k / 2k + 1 share a prompt; prompt labels and right padding ignored; reference noise; KTO's
    desirable flags and its mismatched (KL) rows: row i's prompt with row i − 1's completion."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, SEQ), generator=g)
    labels = ids.clone()
    for k in range(rows // 2):
        prompt = int(torch.randint(1, SEQ // 2, (1,), generator=g))
        ids[2 * k + 1, :prompt] = ids[2 * k, :prompt]
        labels[2 * k : 2 * k + 2, :prompt] = -100
        for r in (2 * k, 2 * k + 1):
            end = int(torch.randint(prompt + 2, SEQ + 1, (1,), generator=g))
            labels[r, end:] = -100
    kl_ids = ids.roll(1, dims=0).clone()
    kl_labels = labels.roll(1, dims=0).clone()
    for r in range(rows):  # row r's prompt (where its own labels are -100 at the start) on row r − 1's tail
        prompt = int((labels[r] == -100).to(torch.int64).cumprod(0).sum())
        kl_ids[r, :prompt] = ids[r, :prompt]
        kl_labels[r, :prompt] = -100
    noise = torch.randn(rows, generator=g, dtype=torch.float64) * 2.0
    kl_noise = torch.randn(rows, generator=g, dtype=torch.float64) - 1.0  # KL = −mean: > 0, not clamped
    desirable = torch.rand(rows, generator=g) < 0.5
    desirable[0], desirable[1] = True, False
    return ids, labels, noise, kl_ids, kl_labels, kl_noise, desirable


def _token_logps(model, ids, labels) -> torch.Tensor:
    """[rows, seq − 1] log p of each label token (0 where ignored), with the graph: the fused head's log_probs."""
    logits = model(input_ids=ids).logits[:, :-1].to(torch.float64)
    target = labels[:, 1:]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)
    return lp * (target != -100)


def _head(per_token):
    """A stand-in for TRL's fused head: `model(..., labels=, fused_lm_head=True)` -> its outputs."""

    def model(input_ids, labels=None, **_):
        lp = per_token[id(input_ids)]
        z = torch.zeros_like(lp.detach())
        return SimpleNamespace(log_probs=lp, entropy=z, mean_logits=z, is_top1=z.bool())

    return model


def _trl_dpo(model, ids, labels, ref, kw) -> torch.Tensor:
    """DPOTrainer._compute_loss on the batch reordered as TRL's [chosen..., rejected...]."""
    order = torch.cat([torch.arange(0, len(ids), 2), torch.arange(1, len(ids), 2)])
    ids_t, labels_t = ids[order], labels[order]
    per_token = _token_logps(model, ids_t, labels_t)
    types = list(kw["loss_type"]) if isinstance(kw["loss_type"], tuple) else [kw["loss_type"]]
    me = trainer_self(
        loss_types=types,
        loss_weights=list(kw.get("loss_weights") or [1.0] * len(types)),
        beta=BETA,
        label_smoothing=kw.get("label_smoothing", 0.0),
    )
    inputs = {
        "input_ids": ids_t,
        "attention_mask": torch.ones_like(ids_t),
        "completion_mask": (labels_t != -100).to(torch.int64),
        "ref_chosen_logps": ref[0::2],
        "ref_rejected_logps": ref[1::2],
    }
    return DPOTrainer._compute_loss(me, _head({id(ids_t): per_token}), inputs, False)


def _trl_simpo(model, ids, labels, kw) -> torch.Tensor:
    lp = _token_logps(model, ids, labels)
    avg = lp.sum(1) / (labels[:, 1:] != -100).sum(1)
    me = trainer_self(alpha=0.0, loss_type="simpo", beta=BETA, simpo_gamma=kw["simpo_gamma"])
    me.label_smoothing = kw["label_smoothing"]
    losses, _, _ = CPOTrainer.cpo_loss(me, avg[0::2], avg[1::2])
    return losses.mean()  # CPO's cpo_alpha = 0 (SimPO)


def _trl_orpo(model, ids, labels) -> torch.Tensor:
    """ORPO's odds-ratio term in float64 with TRL's log1mexp, plus the NLL of the chosen completions."""
    lp = _token_logps(model, ids, labels)
    valid = labels[:, 1:] != -100
    avg = lp.sum(1) / valid.sum(1)
    log_odds = (avg[0::2] - avg[1::2]) - (log1mexp(avg[0::2]) - log1mexp(avg[1::2]))
    ours = BETA * F.logsigmoid(log_odds)
    theirs, *_ = ORPOTrainer.odds_ratio_loss(trainer_self(beta=BETA), avg[0::2].detach(), avg[1::2].detach())
    torch.testing.assert_close(theirs.double(), ours.detach(), rtol=1e-5, atol=1e-6)  # float32 inside TRL
    nll = -lp[0::2][valid[0::2]].mean()
    return nll - ours.mean()


def _trl_kto(model, ids, labels, ref, kl_ids, kl_labels, ref_kl, desirable, kw) -> torch.Tensor:
    per_token = _token_logps(model, ids, labels)
    with torch.no_grad():
        kl_token = _token_logps(model, kl_ids, kl_labels)
    me = trainer_self(
        loss_type=kw["loss_type"],
        beta=BETA,
        calculate_KL=kw["loss_type"] == "kto",
        desirable_weight=kw.get("desirable_weight", 1.0),
        undesirable_weight=kw.get("undesirable_weight", 1.0),
    )
    me._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(me, m, b)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "completion_mask": (labels != -100).to(torch.int64),
        "KL_input_ids": kl_ids,
        "KL_attention_mask": torch.ones_like(kl_ids),
        "KL_completion_mask": (kl_labels != -100).to(torch.int64),
        "label": desirable,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    # TRL's completion_mask marks label tokens at their own position: [:, 1:] is the shifted target mask
    return KTOTrainer._compute_loss(me, _head({id(ids): per_token, id(kl_ids): kl_token}), batch, False)


def _reference(ckpt, data):
    ids, labels, noise, kl_ids, kl_labels, kl_noise, desirable = data
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    with torch.no_grad():
        own = _token_logps(model, ids, labels).sum(1)
        kl_own = _token_logps(model, kl_ids, kl_labels).sum(1)
    ref, ref_kl = own + noise, kl_own + kl_noise
    out = {}
    for name, kw in {**PAIRED, **UNPAIRED}.items():
        model.zero_grad()
        if name == "simpo":
            loss = _trl_simpo(model, ids, labels, kw)
        elif name == "orpo":
            loss = _trl_orpo(model, ids, labels)
        elif name in UNPAIRED:
            loss = _trl_kto(model, ids, labels, ref, kl_ids, kl_labels, ref_kl, desirable, kw)
        else:
            loss = _trl_dpo(model, ids, labels, ref, kw)
        loss.backward()
        out[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out


def _on_ranks(ckpt, data, configs):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.preference import LOSSES, Preference

    ids, labels, noise, kl_ids, kl_labels, kl_noise, desirable = data
    results = {}
    for schedule, method in configs:
        pipe = PipelineModel(
            ckpt,
            PipelineConfig(schedule=schedule, method=method, microbatches=4, attn_implementation="eager"),
            dtype=torch.float64,
        )
        own = pipe.sequence_logps(ids, labels)
        kl_policy = pipe.sequence_logps(kl_ids, kl_labels)  # KTO's KL estimate, as a trainer computes it
        kl = (kl_policy - (kl_policy + kl_noise)).mean()
        for name, kw in {**PAIRED, **UNPAIRED}.items():
            types = kw["loss_type"] if isinstance(kw["loss_type"], tuple) else (kw["loss_type"],)
            needs_ref = any(LOSSES[t].reference for t in types)
            extra = dict(desirable=desirable, kl=float(kl)) if name in UNPAIRED else {}
            pref = Preference(ref_logps=own + noise if needs_ref else None, beta=BETA, **kw, **extra)
            res = pipe.train_step(ids, labels, preference=pref)
            results[(schedule, method, name)] = (res.loss, _gathered_grads(pipe))
            pipe.zero_grad()
        pipe.close()
    return results


def test_trl_losses_on_2_ranks(tmp_path):
    _check(tmp_path, FAST)


@pytest.mark.slow
def test_trl_losses_on_2_ranks_baseline(tmp_path):
    _check(tmp_path, SLOW)


def _check(tmp_path, configs):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_llama(101, tied=False, attn_implementation="eager"))
    ckpt = str(tmp_path / "ckpt")
    model.save_pretrained(ckpt)
    data = _rows(seed, 101, rows=8)
    per_rank = spawn(_on_ranks, 2, ckpt, data, configs, timeout_s=600)
    ref = _reference(ckpt, data)
    for (schedule, method, name), (loss, grads) in per_rank[0].items():
        ref_loss, ref_grads = ref[name]
        what = (schedule, method, name, seed)
        assert loss == pytest.approx(ref_loss, rel=1e-9, abs=1e-12), what
        assert per_rank[1][(schedule, method, name)][0] == pytest.approx(ref_loss, rel=1e-9, abs=1e-12), what
        assert set(grads) == set(ref_grads), what
        for n, g in ref_grads.items():
            err = (grads[n] - g).abs().max().item() / g.abs().max().item()
            assert err < 1e-9, (*what, n, err)


def _dp_ranks(ckpt, data, kw):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.preference import Preference

    ids, labels, noise = data[:3]
    cfg = PipelineConfig(schedule="1f1b", method="vocab-1", microbatches=2, dp_size=2, attn_implementation="eager")
    pipe = PipelineModel(ckpt, cfg, dtype=torch.float64)
    rows = ids.shape[0] // 2
    sl = slice(pipe.dp_rank * rows, (pipe.dp_rank + 1) * rows)
    own = pipe.sequence_logps(ids[sl], labels[sl])
    res = pipe.train_step(ids[sl], labels[sl], preference=Preference(ref_logps=own + noise[sl], beta=BETA, **kw))
    grads = _gathered_grads(pipe)
    pipe.close()
    return res.loss, grads


@pytest.mark.slow
def test_sft_token_mean_is_per_replica_as_under_ddp(tmp_path):
    """Two data-parallel replicas: [sigmoid, sft]'s loss and gradients are the mean over replicas of TRL's loss
    on each replica's rows (DDP averages gradients; TRL's sft is a token mean of the device's batch)."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_llama(101, tied=False, attn_implementation="eager")).save_pretrained(
        tmp_path / "ckpt"
    )
    ckpt, data, kw = str(tmp_path / "ckpt"), _rows(seed, 101, rows=8), PAIRED["rpo"]
    per_rank = spawn(_dp_ranks, 2, ckpt, data, kw, timeout_s=600)
    ids, labels, noise = data[:3]
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    with torch.no_grad():
        ref = _token_logps(model, ids, labels).sum(1) + noise
    loss = sum(
        _trl_dpo(model, ids[4 * r : 4 * r + 4], labels[4 * r : 4 * r + 4], ref[4 * r : 4 * r + 4], kw) for r in (0, 1)
    )
    (loss / 2).backward()
    for r in (0, 1):
        assert per_rank[r][0] == pytest.approx(loss.item() / 2, rel=1e-9), (r, seed)
    for n, p in model.named_parameters():
        err = (per_rank[0][1][n] - p.grad).abs().max().item() / p.grad.abs().max().item()
        assert err < 1e-9, (n, err, seed)
