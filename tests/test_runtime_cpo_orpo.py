"""SimPO, CPO's sigmoid / hinge / ipo and ORPO as TRL 1.16's CPOTrainer and ORPOTrainer compute them, under
vocabulary parallelism on 2 ranks.

The reference is each trainer's own `get_batch_loss_metrics` on the single-process HF model in float64 (its
`concatenated_forward`, `get_batch_logps` and metrics run as written, on a stand-in `self`), on right-padded
pairs whose longest row is shorter than the sequence: CPO's `simpo` with its NLL term (`[simpo, sft]` with
loss_weights [1, cpo_alpha]); CPOTrainer's own sigmoid (with label smoothing and cpo_alpha), hinge (cpo_alpha 0)
and ipo as `cpo_sigmoid`, `cpo_hinge`, `cpo_ipo` (reference-free; logps/* sums for sigmoid and hinge, averages for
ipo); ORPO (`[sft, orpo]`), whose NLL counts the chosen rows' prompt tokens too
(`Preference.completion_start`). ORPOTrainer's `odds_ratio_loss` casts to float32, so its float64 stand-in is
its formula over TRL's own `log1mexp`, checked against it to float32 precision. Loss, every gradient (gathered
into HF names) and every metric TRL logs — rewards/*, logps/*, logits/* (their mean over
every position of the batch padded to its longest row, prompt and padding included; ORPO's without the last),
nll_loss, ORPO's log_odds_ratio and log_odds_chosen — must agree. Fails on the code before (ORPO's NLL on the
completion only, logits/* over completion tokens, no nll_loss / log_odds_*; no `cpo_*` losses).
"""

from __future__ import annotations

import functools
import random
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.experimental.orpo.orpo_trainer import log1mexp  # noqa: E402

from helpers.grads import gathered_grads as _gathered_grads  # noqa: E402
from helpers.trl_stub import trainer_self  # noqa: E402

SEQ, PAIRS, BETA, ALPHA = 14, 4, 0.7, 0.6
CPO = dict(loss_type=("simpo", "sft"), loss_weights=(1.0, ALPHA), label_smoothing=0.1, simpo_gamma=0.4)
ORPO = dict(loss_type=("sft", "orpo"))


def _pairs(seed: int, vocab: int):
    """ids, attention mask, completion-only labels and each row's first completion position; pair k's rows
    2k / 2k + 1 share a prompt; rows right-padded with 0, the longest shorter than SEQ."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * PAIRS
    ids = torch.randint(3, vocab, (rows, SEQ), generator=g)
    mask = torch.zeros(rows, SEQ, dtype=torch.int64)
    labels = torch.full((rows, SEQ), -100)
    starts = torch.zeros(rows, dtype=torch.int64)
    for k in range(PAIRS):
        prompt = int(torch.randint(2, 5, (1,), generator=g))
        ids[2 * k + 1, :prompt] = ids[2 * k, :prompt]
        for r in (2 * k, 2 * k + 1):
            end = int(torch.randint(prompt + 2, SEQ - 1, (1,), generator=g))
            ids[r, end:] = 0
            mask[r, :end] = 1
            labels[r, prompt:end] = ids[r, prompt:end]
            starts[r] = prompt
    return ids, mask, labels, starts


def _orpo_labels(ids, mask, labels):
    """ORPO's rows: the chosen rows' prompt tokens labelled too."""
    out = labels.clone()
    out[0::2] = torch.where(mask[0::2] == 1, ids[0::2], -100)
    return out


def _trl_batch(ids, mask, labels):
    longest = int(mask.sum(1).max())
    out = {}
    for side, sl in (("chosen", slice(0, None, 2)), ("rejected", slice(1, None, 2))):
        out[f"{side}_input_ids"] = ids[sl, :longest]
        out[f"{side}_attention_mask"] = mask[sl, :longest]
        out[f"{side}_labels"] = labels[sl, :longest]
    return out


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)


def _trl_cpo(
    model, batch, loss_type="simpo", cpo_alpha=ALPHA, beta=BETA, label_smoothing=CPO["label_smoothing"], alpha=0.0
):
    me = SimpleNamespace(
        accelerator=_accelerator(),
        is_encoder_decoder=False,
        pad_token_id=0,
        aux_loss_enabled=False,
        cpo_alpha=cpo_alpha,
        loss_type=loss_type,
        alpha=alpha,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=CPO["simpo_gamma"],
        concatenated_inputs=CPOTrainer.concatenated_inputs,
        get_batch_logps=CPOTrainer.get_batch_logps,
    )
    me.concatenated_forward = types.MethodType(CPOTrainer.concatenated_forward, me)
    me.cpo_loss = types.MethodType(CPOTrainer.cpo_loss, me)
    return CPOTrainer.get_batch_loss_metrics(me, model, batch)


def _odds_ratio_loss64(me, chosen, rejected):
    """ORPOTrainer.odds_ratio_loss without its float32 cast (checked against it below)."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    theirs = ORPOTrainer.odds_ratio_loss(me, chosen.detach(), rejected.detach())
    torch.testing.assert_close(theirs[0].double(), BETA * ratio.detach(), rtol=1e-5, atol=1e-6)
    return BETA * ratio, BETA * chosen.detach(), BETA * rejected.detach(), ratio.mean(), log_odds.mean()


def _trl_orpo(model, batch):
    me = SimpleNamespace(
        accelerator=_accelerator(),
        is_encoder_decoder=False,
        padding_value=0,
        aux_loss_enabled=False,
        beta=BETA,
        concatenated_inputs=ORPOTrainer.concatenated_inputs,
        get_batch_logps=ORPOTrainer.get_batch_logps,
    )
    me.concatenated_forward = types.MethodType(ORPOTrainer.concatenated_forward, me)
    me.odds_ratio_loss = types.MethodType(_odds_ratio_loss64, me)
    return ORPOTrainer.get_batch_loss_metrics(me, model, batch)


CPO_BETA = 0.1  # CPOConfig's default: β·(log π_w − log π_l) on sums stays where every loss has a gradient
CPO_LOSSES = {  # CPOConfig's loss_type (with its cpo_alpha and label_smoothing) -> our Preference arguments
    "sigmoid": (ALPHA, 0.1, dict(loss_type=("cpo_sigmoid", "sft"), loss_weights=(1.0, ALPHA), label_smoothing=0.1)),
    "hinge": (0.0, 0.0, dict(loss_type="cpo_hinge")),
    "ipo": (ALPHA, 0.0, dict(loss_type=("cpo_ipo", "sft"), loss_weights=(1.0, ALPHA))),
}
"""CPOTrainer's own loss types: sigmoid (its default, with label smoothing and the NLL term cpo_alpha), hinge
(cpo_alpha 0: nll_loss logged 0), ipo (on per-token averages, logged as averages)."""


def _cases(ids, mask, labels, starts):
    """name -> (Preference arguments, the labels, completion_start, TRL's loss and metrics on the HF model)."""
    orpo_rows = _orpo_labels(ids, mask, labels)
    cases = {
        "simpo": (dict(beta=BETA, **CPO), labels, None, _trl_cpo),
        "orpo": (dict(beta=BETA, **ORPO), orpo_rows, starts, _trl_orpo),
    }
    for name, (alpha, eps, kw) in CPO_LOSSES.items():
        trl_fn = functools.partial(_trl_cpo, loss_type=name, cpo_alpha=alpha, beta=CPO_BETA, label_smoothing=eps)
        cases[f"cpo_{name}"] = (dict(beta=CPO_BETA, **kw), labels, None, trl_fn)
    # AlphaPO (CPOConfig's alpha): TRL's `alphapo` is simpo with alpha and no NLL term; on sums (sigmoid) a small α
    # keeps π^−α of a whole completion finite
    ours = {k: v for k, v in CPO.items() if k not in ("loss_type", "loss_weights")}
    trl_fn = functools.partial(_trl_cpo, cpo_alpha=0.0, alpha=0.6)
    cases["alphapo"] = (dict(beta=BETA, loss_type="simpo", alpha=0.6, **ours), labels, None, trl_fn)
    trl_fn = functools.partial(_trl_cpo, loss_type="sigmoid", beta=CPO_BETA, label_smoothing=0.1, alpha=0.05)
    kw = dict(CPO_LOSSES["sigmoid"][2], alpha=0.05)
    cases["cpo_sigmoid_alpha"] = (dict(beta=CPO_BETA, **kw), labels, None, trl_fn)
    return cases


def _on_ranks(ckpt, data, method):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.preference import Preference

    ids, mask, labels, starts = data
    cfg = PipelineConfig(schedule="1f1b", method=method, microbatches=2, attn_implementation="eager")
    pipe = PipelineModel(ckpt, cfg, dtype=torch.float64)
    out = {}
    for name, (kw, rows, start, _) in _cases(ids, mask, labels, starts).items():
        res = pipe.train_step(ids, rows, mask, preference=Preference(ref_logps=None, completion_start=start, **kw))
        out[name] = (res.loss, res.rewards, _gathered_grads(pipe))
        pipe.zero_grad()
    pipe.close()
    return out


def _seeded_pairs(tmp_path):
    """(seed, checkpoint dir, pairs): a fresh seed, an untied eager tiny Llama saved as users save it, its pairs."""
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_llama(101, tied=False, attn_implementation="eager")).save_pretrained(
        tmp_path / "ckpt"
    )
    return seed, str(tmp_path / "ckpt"), _pairs(seed, 101)


@pytest.mark.parametrize("method", ["vocab-2", pytest.param("baseline", marks=pytest.mark.slow)])
def test_cpo_losses_and_orpo_are_cpo_and_orpo_trainers_on_2_ranks(tmp_path, method):
    """SimPO, CPO's sigmoid / hinge / ipo (`cpo_sigmoid`, `cpo_hinge`, `cpo_ipo`: fails on the code before them)
    and ORPO: loss, every metric and every gradient as CPOTrainer / ORPOTrainer compute them, in one spawn."""
    seed, ckpt, data = _seeded_pairs(tmp_path)
    per_rank = spawn(_on_ranks, 2, ckpt, data, method, timeout_s=600)
    ids, mask, labels, starts = data
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    for name, (_, rows, _, trl_fn) in _cases(ids, mask, labels, starts).items():
        model.zero_grad()
        batch = _trl_batch(ids, mask, labels)
        if name == "orpo":  # ORPOTrainer's NLL reads input_ids where attention_mask; its logps the labels
            assert torch.equal(_trl_batch(ids, mask, rows)["chosen_input_ids"], batch["chosen_input_ids"])
        loss, metrics = trl_fn(model, batch)
        loss.backward()
        for r in (0, 1):
            got_loss, rewards, grads = per_rank[r][name]
            what = (name, method, r, seed)
            assert got_loss == pytest.approx(loss.item(), rel=1e-9, abs=1e-12), what
            assert set(rewards) == set(metrics), (what, sorted(rewards), sorted(metrics))
            for key, want in metrics.items():
                assert rewards[key] == pytest.approx(want, rel=1e-6, abs=1e-9), (*what, key)
            for n, p in model.named_parameters() if r == 0 else ():  # gathered on rank 0
                scale = p.grad.abs().max().item() or 1.0  # hinge: 0 when every pair is past its margin
                err = (grads[n] - p.grad).abs().max().item() / scale
                assert err < 1e-9, (*what, n, err)


def _dpo_on_ranks(ckpt, data, noise, method):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.preference import Preference

    ids, mask, labels, _ = data
    cfg = PipelineConfig(schedule="1f1b", method=method, microbatches=2, attn_implementation="eager")
    pipe = PipelineModel(ckpt, cfg, dtype=torch.float64)
    ref = pipe.sequence_logps(ids, labels, mask) + noise
    res = pipe.train_step(ids, labels, mask, preference=Preference(ref_logps=ref, beta=BETA))
    pipe.close()
    return res.rewards, ref


def _trl_dpo_metrics(model, ids, mask, labels, ref):
    """DPOTrainer._compute_loss with TRL's own fused head (`add_fused_lm_head`: entropy, mean logits, top-1) on
    the batch as TRL orders it, [chosen..., rejected...]; its logged metrics."""

    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    order = torch.cat([torch.arange(0, len(ids), 2), torch.arange(1, len(ids), 2)])
    me = trainer_self(
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=BETA,
        label_smoothing=0.0,
    )
    inputs = {
        "input_ids": ids[order],
        "attention_mask": mask[order],
        "completion_mask": (labels[order] != -100).to(torch.int64),
        "ref_chosen_logps": ref[0::2],
        "ref_rejected_logps": ref[1::2],
    }
    with torch.no_grad():
        DPOTrainer._compute_loss(me, model, inputs, False)
    return {k: sum(v) / len(v) for k, v in me._metrics["train"].items()}


@pytest.mark.parametrize("method", ["vocab-1", "vocab-2", pytest.param("baseline", marks=pytest.mark.slow)])
def test_dpo_entropy_and_token_accuracy_are_dpo_trainers_on_2_ranks(tmp_path, method):
    """DPOTrainer's `entropy` (over every completion token) and `mean_token_accuracy` (the chosen completions'
    top-1 hits), with logits/* and the rewards, from C1's statistics (no collective of their own). TRL's fused
    head works in float32 (its log-probabilities too), so they agree to 1e-6; the top-1 hits exactly."""
    seed, ckpt, data = _seeded_pairs(tmp_path)
    noise = torch.randn(2 * PAIRS, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    per_rank = spawn(_dpo_on_ranks, 2, ckpt, data, noise, method, timeout_s=600)
    ids, mask, labels, _ = data
    model = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    rewards, ref = per_rank[0]
    want = _trl_dpo_metrics(model, ids, mask, labels, ref)
    assert 0 < want["mean_token_accuracy"] or want["entropy"] > 0
    for name in ("entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected"):
        for r in (0, 1):
            # TRL's fused head computes entropy and mean logits in float32: agreement to its precision
            assert per_rank[r][0][name] == pytest.approx(want[name], rel=1e-6, abs=1e-9), (name, method, r, seed)
