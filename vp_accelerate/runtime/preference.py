"""Preference optimisation (TRL's DPO losses, CPO's and SimPO, ORPO's odds ratio, KTO) as a loss of whole sequences.

A step's batch holds pairs: row 2k is pair k's chosen completion, row 2k + 1 its rejected one (KTO: unpaired
rows, each desirable or not), with the prompt's labels ignored (-100), so a row's log-probability log π(y|x)
is minus the sum of its per-token cross-entropy. Every loss here is a function of the rows' sums only (and of
counts the host knows), so dL/dCE_t = −dL/dlog π(row) for a completion token and 0 for a prompt token:
exactly the per-token g the vocabulary-parallel output layer takes after C1 (every rank has each token's
loss then), so T, ∇x and the pipeline's backward follow unchanged (vocab/output_layer.py `SequenceLossFn`)
and no loss needs a collective of its own. dL/dlog π is taken by autograd over the microbatch's [rows]
float64 sums (`FORMULAS` below: TRL's formulas, one per entry of preference_config.py's table `LOSSES`), so a
loss is written once, as TRL writes it. The baseline
applies the same g to its autograd CE (runtime/executor.py). A pair's two rows must share a microbatch:
microbatches hold an even number of rows.

With m = [log π(y_w) − log π_ref(y_w)] − [log π(y_l) − log π_ref(y_l)] and ε = label_smoothing:

    sigmoid   −log σ(βm)                          (DPO)
    hinge     max(0, 1 − βm)
    ipo       (m̄ − 1/(2β))²                      m̄ on per-token averages
    robust    (−(1−ε) log σ(βm) + ε log σ(−βm)) / (1 − 2ε)
    apo_zero  1 − σ(β r_w) + σ(β r_l)             r = log π − log π_ref
    sft       −Σ chosen log π / chosen tokens     (RPO / MPO's NLL term; a replica's token mean, as DDP)
    simpo     −(1−ε) log σ(βd) − ε log σ(−βd)     d = avg log π_w − avg log π_l − γ/β (CPO's `simpo`)
    cpo_sigmoid  −(1−ε) log σ(βd) − ε log σ(−βd)  d = log π_w − log π_l (CPOTrainer's `sigmoid`: no reference)
    cpo_hinge    max(0, 1 − βd)                   d = log π_w − log π_l (CPOTrainer's `hinge`)
    cpo_ipo      (d̄ − 1/(2β))²                   d̄ = avg log π_w − avg log π_l (CPOTrainer's `ipo`)
    orpo      −β log σ(log odds_w − log odds_l)   odds on avg log π (ORPOTrainer's odds-ratio term)
    (AlphaPO: with α ≠ 0 the CPOTrainer losses, simpo and cpo_*, take r = (1 − π^−α)/α of the log π they use,
    sums or averages, in place of log π, as CPOConfig's `alpha` does; their rewards/* too)
    kto       w_d (1 − σ(β(r − z))) desirable, w_u (1 − σ(β(z − r))) undesirable; z = max(KL, 0), given
    apo_zero_unpaired   1 − σ(βr) desirable, σ(βr) undesirable

each a mean over the step's pairs (KTO: rows), summed with `loss_weights` (TRL's `loss_type` list).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from vp_accelerate.runtime.preference_config import LOSSES, PreferenceConfig, alpha_problem, loss_types

__all__ = ["LOSSES", "FORMULAS", "Preference"]


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, branched at −ln 2 as TRL's ORPO does."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@dataclass
class _Rows:
    """A microbatch's per-row quantities, float64 [rows] (pairs: even rows chosen, odd rejected)."""

    logps: torch.Tensor
    """Σ log π over each row's label tokens (the autograd leaf)."""
    ref: torch.Tensor
    """Σ log π_ref, the same sums under the reference model (zeros when reference-free)."""
    tokens: torch.Tensor
    """Label tokens per row (≥ 1)."""
    desirable: torch.Tensor | None
    """KTO: [rows] bool; None for pairs."""
    kl: float = 0.0
    """KTO: this microbatch's KL estimate z (`Preference.kl_of`)."""
    full: torch.Tensor | None = None
    """Σ log π over every label token of each row, prompt included where labelled (ORPO's NLL: the second
    autograd leaf); None: the same as `logps`."""


def _shaped(logps: torch.Tensor, p: Preference) -> torch.Tensor:
    """AlphaPO's reward shape of log-probabilities (CPOTrainer's `alpha`): (1 − π^−α)/α = −expm1(−α log π)/α, the
    log-probabilities themselves at α = 0 (its limit)."""
    return logps if p.alpha == 0 else -torch.expm1(-p.alpha * logps) / p.alpha


def _margin(r: _Rows) -> torch.Tensor:
    ratio = r.logps - r.ref
    return ratio[0::2] - ratio[1::2]


def _full(r: _Rows) -> torch.Tensor:
    return r.logps if r.full is None else r.full


def _avg(r: _Rows) -> torch.Tensor:
    return r.logps / r.tokens


def _ipo(r: _Rows, p: Preference) -> torch.Tensor:
    ratio = (r.logps - r.ref) / r.tokens
    return (ratio[0::2] - ratio[1::2] - 1 / (2 * p.beta)) ** 2


def _robust(r: _Rows, p: Preference) -> torch.Tensor:
    bm, eps = p.beta * _margin(r), p.label_smoothing
    return (-(1 - eps) * F.logsigmoid(bm) + eps * F.logsigmoid(-bm)) / (1 - 2 * eps)


def _apo_zero(r: _Rows, p: Preference) -> torch.Tensor:
    ratio = r.logps - r.ref
    return 1 - torch.sigmoid(p.beta * ratio[0::2]) + torch.sigmoid(p.beta * ratio[1::2])


def _simpo(r: _Rows, p: Preference) -> torch.Tensor:
    avg = _shaped(_avg(r), p)
    d = avg[0::2] - avg[1::2] - p.simpo_gamma / p.beta
    eps = p.label_smoothing
    return -F.logsigmoid(p.beta * d) * (1 - eps) - F.logsigmoid(-p.beta * d) * eps


def _cpo_sums(r: _Rows, p: Preference) -> torch.Tensor:
    """log π_w − log π_l (AlphaPO-shaped with α ≠ 0): CPOTrainer's sigmoid and hinge margin, no reference."""
    shaped = _shaped(r.logps, p)
    return shaped[0::2] - shaped[1::2]


def _cpo_sigmoid(r: _Rows, p: Preference) -> torch.Tensor:
    d, eps = _cpo_sums(r, p), p.label_smoothing  # no reference, even beside a loss that has one
    return -F.logsigmoid(p.beta * d) * (1 - eps) - F.logsigmoid(-p.beta * d) * eps


def _cpo_ipo(r: _Rows, p: Preference) -> torch.Tensor:
    avg = _shaped(_avg(r), p)
    return (avg[0::2] - avg[1::2] - 1 / (2 * p.beta)) ** 2


def _orpo(r: _Rows, p: Preference) -> torch.Tensor:
    avg = _avg(r)
    log_odds = (avg[0::2] - avg[1::2]) - (_log1mexp(avg[0::2]) - _log1mexp(avg[1::2]))
    return -p.beta * F.logsigmoid(log_odds)


def _kto(r: _Rows, p: Preference) -> torch.Tensor:
    ratio, z = r.logps - r.ref, max(r.kl, 0.0)
    d = r.desirable
    return torch.where(
        d,
        p.desirable_weight * (1 - torch.sigmoid(p.beta * (ratio - z))),
        p.undesirable_weight * (1 - torch.sigmoid(p.beta * (z - ratio))),
    )


def _apo_zero_unpaired(r: _Rows, p: Preference) -> torch.Tensor:
    ratio = r.logps - r.ref
    s = torch.sigmoid(p.beta * ratio)
    return torch.where(r.desirable, p.desirable_weight * (1 - s), p.undesirable_weight * s)


FORMULAS: dict[str, Callable[[_Rows, Preference], torch.Tensor]] = {
    "sigmoid": lambda r, p: -F.logsigmoid(p.beta * _margin(r)),
    "ipo": _ipo,
    "hinge": lambda r, p: torch.relu(1 - p.beta * _margin(r)),
    "robust": _robust,
    "apo_zero": _apo_zero,
    "sft": lambda r, p: -_full(r)[0::2].sum(),
    "simpo": _simpo,
    "cpo_sigmoid": _cpo_sigmoid,
    "cpo_hinge": lambda r, p: torch.relu(1 - p.beta * _cpo_sums(r, p)),
    "cpo_ipo": _cpo_ipo,
    "orpo": _orpo,
    "kto": _kto,
    "apo_zero_unpaired": _apo_zero_unpaired,
}
"""(rows, preference) -> per-item losses of every loss of `LOSSES`: [pairs], or [rows] for unpaired ones, or a
scalar sum for a `token_mean` one (`sft`)."""
LOSS_TYPES = tuple(LOSSES)


def metric_style(types: tuple[str, ...]) -> str:
    """Whose metrics a step logs (`LossKind.trainer`): "orpo" (ORPOTrainer), "cpo" (CPOTrainer: SimPO and
    `cpo_*`) or "dpo" (DPOTrainer, and KTOTrainer for unpaired rows)."""
    trainers = {LOSSES[t].trainer for t in types if t in LOSSES}
    return "orpo" if "orpo" in trainers else "cpo" if "cpo" in trainers else "dpo"


@dataclass(frozen=True)
class Preference:
    """What `PipelineModel.train_step` needs to train on preference pairs (its rows interleave chosen and
    rejected: row 2k chosen, row 2k + 1 rejected) or on KTO's unpaired rows (`desirable`)."""

    ref_logps: torch.Tensor | None
    """[batch] the reference model's log π_ref(row) (a sum over the row's label tokens; `sequence_logps`);
    None when every loss is reference-free (`sft`, `simpo`, `cpo_*`, `orpo`)."""
    beta: float = 0.1
    """β: the strength of the implicit KL penalty (TRL's `beta`; SimPO's β, ORPO's λ)."""
    loss_type: str | tuple[str, ...] | list[str] = "sigmoid"
    """One of `LOSS_TYPES` or a list of them, as TRL's `loss_type`; their losses are summed with weights."""
    loss_weights: tuple[float, ...] | list[float] | None = None
    """One weight per `loss_type` entry (TRL's `loss_weights`); None = all 1."""
    label_smoothing: float = 0.0
    """ε of `robust` (in [0, 0.5)), `simpo` and `cpo_sigmoid` (TRL's `label_smoothing`)."""
    simpo_gamma: float = 0.5
    """γ of `simpo`: the target margin (CPO's `simpo_gamma`)."""
    alpha: float = 0.0
    """AlphaPO's α (CPOConfig's `alpha`): the CPOTrainer losses (`simpo`, `cpo_*`) on (1 − π^−α)/α; 0 = log π."""
    desirable: torch.Tensor | None = None
    """KTO: [batch] bool, True for a desirable row (TRL's `label`); needed by `kto` / `apo_zero_unpaired`."""
    kl: float | tuple[float, ...] = 0.0
    """KTO's KL estimate z: one for the step, or one per microbatch as TRL's KTOTrainer has one per gradient-
    accumulation micro-step (`PipelineModel.kl_estimate`: mean over a microbatch's mismatched prompt/completion
    rows of log π − log π_ref, averaged over the replicas; a constant, clamped at 0 as TRL does)."""
    desirable_weight: float = 1.0
    """KTO's weight of desirable rows' losses."""
    undesirable_weight: float = 1.0
    """KTO's weight of undesirable rows' losses."""
    completion_start: torch.Tensor | None = None
    """[batch] int: each row's first completion position, where the labels also cover the prompt (ORPO: its
    NLL counts the chosen rows' prompt tokens as ORPOTrainer's does; log π and every other loss count the
    completion only). None: the labels are the completion's."""

    @classmethod
    def of(cls, config: PreferenceConfig, ref_logps, desirable=None, kl=0.0, completion_start=None) -> Preference:
        """The step's Preference: the recipe's `preference` section (`PreferenceConfig`, every setting as it is)
        with the batch's reference log-probabilities, KTO's desirable flags and KL estimate, ORPO's prompt ends."""
        settings = {f: getattr(config, f) for f in PreferenceConfig.__dataclass_fields__}
        return cls(ref_logps, desirable=desirable, kl=kl, completion_start=completion_start, **settings)

    @property
    def types(self) -> tuple[str, ...]:
        return loss_types(self.loss_type)

    @property
    def weights(self) -> tuple[float, ...]:
        return tuple(self.loss_weights) if self.loss_weights is not None else (1.0,) * len(self.types)

    def kl_of(self, microbatch: int) -> float:
        """z of one microbatch."""
        return float(self.kl) if isinstance(self.kl, (int, float)) else float(self.kl[microbatch])

    @property
    def unpaired(self) -> bool:
        return any(LOSSES[t].unpaired for t in self.types if t in LOSSES)

    def check(self, batch: int, microbatches: int) -> None:
        types = self.types
        bad = [t for t in types if t not in LOSSES]
        if bad or not types:
            raise ValueError(f"loss_type must be one or more of {LOSS_TYPES}, got {self.loss_type!r}")
        if len(self.weights) != len(types):
            raise ValueError(f"loss_weights has {len(self.weights)} entries for {len(types)} loss types {types}")
        if len({LOSSES[t].unpaired for t in types}) > 1:
            raise ValueError(f"loss_type {types}: KTO's unpaired losses do not mix with pair losses")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if alpha_problem(self.alpha, types):
            raise ValueError(f"alpha {alpha_problem(self.alpha, types)}")
        if "robust" in types and not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5) for robust, got {self.label_smoothing}")
        if self.ref_logps is None:
            if any(LOSSES[t].reference for t in types):
                raise ValueError(f"loss_type {types} needs the reference log-probabilities (ref_logps)")
        elif tuple(self.ref_logps.shape) != (batch,):
            raise ValueError(f"ref_logps must be [batch] = [{batch}], got {tuple(self.ref_logps.shape)}")
        if self.completion_start is not None and tuple(self.completion_start.shape) != (batch,):
            raise ValueError(f"completion_start must be [batch] = [{batch}], got {tuple(self.completion_start.shape)}")
        if self.unpaired:
            if self.desirable is None or tuple(self.desirable.shape) != (batch,):
                raise ValueError(f"loss_type {types} needs `desirable`, a [batch] = [{batch}] bool per row")
            if not isinstance(self.kl, (int, float)) and len(self.kl) != microbatches:
                raise ValueError(f"kl: one value per microbatch ({microbatches}) or one for the step, got {self.kl}")
        elif (batch // microbatches) % 2:
            raise ValueError(
                f"a preference batch of {batch} rows in {microbatches} microbatches puts {batch // microbatches} "
                f"rows in each; a pair's chosen and rejected must share a microbatch, so use an even number of "
                f"rows per microbatch (batch = 2 x pairs, pairs a multiple of microbatches)"
            )


@dataclass
class PairLoss:
    """One microbatch's preference loss (`vocab.output_layer.SequenceLossFn`); it keeps the rows'
    log-probabilities of its last call for the step's reward metrics."""

    labels: torch.Tensor
    """[rows, seq] shifted labels (-100 at prompt, padding and the last position)."""
    ref_logps: torch.Tensor | None
    """[rows] float64 log π_ref, sums over each row's label tokens (None: reference-free)."""
    preference: Preference
    """The step's losses and their settings."""
    pairs: int
    """P: pairs in the whole step, over every data-parallel replica (pair losses are their mean)."""
    rows: int = 0
    """Rows in the whole step, over every replica: KTO's row losses are their mean (TRL: each micro-step's
    mean, averaged over micro-steps and replicas, the same for equal microbatches)."""
    kl: float = 0.0
    """KTO: this microbatch's KL estimate z."""
    dp_size: int = 1
    """Data-parallel replicas: `sft`'s token mean is a replica's, averaged over replicas (as DDP does)."""
    chosen_tokens: torch.Tensor | None = None
    """`sft`: the label tokens of this replica's chosen rows, over every microbatch of the step."""
    desirable: torch.Tensor | None = None
    """KTO: [rows] bool for this microbatch's rows."""
    loss_scale: float = 1.0
    """fp16's loss scale: g and the loss term carry it, as the token loss's grad_scale does."""
    completion_start: torch.Tensor | None = None
    """[rows] this microbatch's `Preference.completion_start` (None: every label token is the completion's)."""
    longest: int | None = None
    """The longest row of this replica's step (its attention mask; None: all of seq): CPOTrainer / ORPOTrainer
    average logits/* over the batch padded to its longest row."""
    microbatches: int = 1
    """Microbatches of the step: this replica's rows are theirs together."""
    logps: torch.Tensor | None = field(default=None, repr=False)
    """After a call: [rows] float64 log π of this step's policy (sums over each row's label tokens)."""
    mean_logits: torch.Tensor | None = field(default=None, repr=False)
    """[rows x seq] each position's logits averaged over the vocabulary (TRL's logits/* metrics), when recorded."""
    entropy: torch.Tensor | None = field(default=None, repr=False)
    """[rows, seq] each position's entropy of the softmax over the vocabulary (TRL's DPO `entropy`), when recorded."""
    top1: torch.Tensor | None = field(default=None, repr=False)
    """[rows, seq] bool: the label is the position's top-1 logit (TRL's DPO `mean_token_accuracy`)."""
    full_logps: torch.Tensor | None = field(default=None, repr=False)
    """After a call: [rows] Σ log π over every label token, prompt included where labelled (ORPO's NLL)."""

    wants_mean_logits = True  # the output layer (or the baseline) hands them over: `record_mean_logits`

    def record_mean_logits(self, mean_logits: torch.Tensor) -> None:
        """Keep each position's mean logit over the whole vocabulary (under vocabulary parallelism its sum
        rode on C1's first all-reduce)."""
        self.mean_logits = mean_logits.detach().to(torch.float64).reshape(self.labels.shape)

    @property
    def style(self) -> str:
        return metric_style(self.preference.types)

    def _completion(self) -> torch.Tensor:
        """[rows, seq] bool: the label positions of the completion (position t predicts token t + 1)."""
        valid = self.labels != -100
        if self.completion_start is None:
            return valid
        col = torch.arange(self.labels.shape[1], device=self.labels.device)
        start = self.completion_start.to(self.labels.device)
        return valid & (col[None, :] >= start[:, None] - 1)

    def record_token_stats(self, entropy: torch.Tensor, top1: torch.Tensor) -> None:
        """Keep each position's entropy and whether its label is the top-1 logit (under vocabulary parallelism
        from C1's statistics: the max and the target logit of its first all-reduce, Σ e^(z−m) z beside Σ e^(z−m)
        in its second)."""
        self.entropy = entropy.detach().to(torch.float64).reshape(self.labels.shape)
        self.top1 = top1.detach().reshape(self.labels.shape)

    def _tokens(self) -> torch.Tensor:
        return self._completion().sum(dim=1).to(torch.float64).clamp(min=1)

    def _ref(self, device) -> torch.Tensor:
        rows = self.labels.shape[0]
        if self.ref_logps is None:
            return torch.zeros(rows, dtype=torch.float64, device=device)
        return self.ref_logps.to(device=device, dtype=torch.float64)

    def loss_and_grad(self, logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this microbatch's share of the step loss, dL/dlog π per row), float64."""
        loss, grad, _ = self.loss_and_grads(logps)
        return loss, grad

    def loss_and_grads(
        self, logps: torch.Tensor, full: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(this microbatch's share of the step loss, dL/dlog π per row, dL/d`full` per row), float64; `full`:
        Σ log π over every label token where the prompt is labelled (ORPO's NLL), else the NLL reads `logps`."""
        p = self.preference
        leaf = logps.detach().to(torch.float64).requires_grad_()
        other = None if full is None else full.detach().to(torch.float64).requires_grad_()
        desirable = None if self.desirable is None else self.desirable.to(leaf.device)
        rows = _Rows(leaf, self._ref(leaf.device), self._tokens().to(leaf.device), desirable, self.kl, other)
        with torch.enable_grad():
            total = leaf.new_zeros(())
            for name, weight in zip(p.types, p.weights):
                kind = LOSSES[name]
                value = FORMULAS[name](rows, p)
                if kind.token_mean:
                    denom = self.chosen_tokens.to(leaf.device, torch.float64).clamp(min=1) * self.dp_size
                    total = total + weight * value / denom
                else:
                    items = self.rows if kind.unpaired else self.pairs
                    total = total + weight * value.sum() / items
            leaves = [leaf] if other is None else [leaf, other]
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
        grads = [torch.zeros_like(leaf) if g is None else g for g in grads]
        return total.detach(), grads[0], grads[1] if other is not None else torch.zeros_like(leaf)

    def __call__(self, token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.labels.shape[0]
        ce = token_loss.detach().to(torch.float64).reshape(rows, -1)
        valid = self.labels.to(ce.device) != -100
        completion = self._completion().to(ce.device)
        logps = -torch.where(completion, ce, 0.0).sum(dim=1)
        full = None if self.completion_start is None else -torch.where(valid, ce, 0.0).sum(dim=1)
        loss, dlogp, dfull = self.loss_and_grads(logps, full)
        # dCE_t = −dL/dlog π(row) on the completion, −dL/dfull(row) on every label token (ORPO's NLL)
        g = torch.where(completion, -dlogp[:, None], 0.0) + torch.where(valid, -dfull[:, None], 0.0)
        self.logps, self.full_logps = logps, logps if full is None else full
        return (g * self.loss_scale).reshape(-1).to(token_loss.dtype), loss * self.loss_scale

    def logged_logps(self) -> torch.Tensor:
        """The log π TRL logs (logps/*, and inside rewards/*): per-token averages where the trainer works on
        them (CPOTrainer's simpo and ipo, ORPOTrainer: `LossKind.averaged`), sums otherwise (DPOTrainer, IPO
        included: only its loss is length-normalised; CPOTrainer's sigmoid and hinge)."""
        if any(LOSSES[t].averaged for t in self.preference.types):
            return self.logps / self._tokens().to(self.logps.device)
        return self.logps

    def rewards(self) -> torch.Tensor:
        """[REWARD_SUMS] sums over this microbatch's pairs of: chosen reward, rejected reward, chosen > rejected,
        margin, chosen log π, rejected log π; then Σ of the chosen / rejected completions' mean logits and their
        token counts. As TRL logs them: reward = β (log π − log π_ref) (β log π for the reference-free losses),
        on `logged_logps`. KTO's unpaired rows: the same sums over desirable / undesirable rows."""
        logps = self.logged_logps()
        r = self.preference.beta * (logps - self._ref(logps.device))  # simpo / cpo_* / orpo: reference-free, ref 0
        if self.preference.alpha and metric_style(self.preference.types) == "cpo":  # AlphaPO's rewards: β r(π)
            r = self.preference.beta * _shaped(logps, self.preference)
        valid = self._completion().to(logps.device)
        mean = self.mean_logits if self.mean_logits is not None else torch.zeros(valid.shape, dtype=r.dtype)
        logit_sums = torch.where(valid, mean.to(logps.device), 0.0).sum(dim=1)
        tokens = valid.sum(dim=1).to(r.dtype)
        if self.desirable is not None:  # KTO: unpaired rows
            d = self.desirable.to(r.device)
            first, second = d, ~d
        else:
            first = torch.zeros_like(r, dtype=torch.bool)
            first[0::2] = True
            second = ~first
        chosen, rejected = r[first], r[second]
        # KTO logs no accuracy: the slot counts the desirable rows (TRL's rewards are per-class means)
        accurate = (chosen > rejected).to(r.dtype).sum() if self.desirable is None else first.to(r.dtype).sum()
        return torch.stack(
            [
                chosen.sum(),
                rejected.sum(),
                accurate,
                chosen.sum() - rejected.sum(),
                logps[first].sum(),
                logps[second].sum(),
                logit_sums[first].sum(),
                logit_sums[second].sum(),
                tokens[first].sum(),
                tokens[second].sum(),
                *self._cpo_sums(mean.to(logps.device), first, second),
                *self._token_sums(valid, first),
            ]
        )

    def _token_sums(self, valid: torch.Tensor, first: torch.Tensor) -> list[torch.Tensor]:
        """Σ of the entropy over every completion token, Σ of the chosen completions' top-1 hits (zeros when not
        recorded): DPOTrainer's `entropy` and `mean_token_accuracy` over the token counts already summed."""
        zero = torch.zeros((), dtype=torch.float64, device=valid.device)
        if self.entropy is None or self.top1 is None:
            return [zero, zero]
        entropy = torch.where(valid, self.entropy.to(valid.device), 0.0).sum()
        hits = (self.top1.to(valid.device) & valid)[first].sum().to(torch.float64)
        return [entropy, hits]

    def _cpo_sums(self, mean: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> list[torch.Tensor]:
        """This microbatch's share of its replica's CPOTrainer / ORPOTrainer metrics (zeros for the others), the
        replica's step being one batch of theirs: logits/chosen and logits/rejected as they define them — the
        mean logit over every position of the batch's rows padded to its longest (ORPO: but the last), prompt
        and padding included —, nll_loss (the chosen rows' token-mean NLL: ORPO's over prompt and completion,
        CPO's over the completion, 0 without `sft` as cpo_alpha 0), Σ over pairs of ORPO's log σ(log odds) and
        log odds, and 1 / microbatches (the replicas' means are averaged, as gather_for_metrics does)."""
        zero = mean.new_zeros(())
        style = self.style
        if style == "dpo":
            return [zero] * 6
        longest = mean.shape[1] if self.longest is None else self.longest
        width = longest - 1 if style == "orpo" else longest
        part = mean[:, :width]
        per_side = self.labels.shape[0] // 2 * self.microbatches * width  # the replica's chosen rows x positions
        logit_c, logit_r = part[first].sum() / per_side, part[second].sum() / per_side
        nll = zero
        if style == "orpo" or "sft" in self.preference.types:
            tokens = self.chosen_tokens.to(mean.device, mean.dtype).clamp(min=1)
            nll = -self.full_logps[first].sum().to(mean.dtype) / tokens
        ratio = odds = zero
        if style == "orpo":
            avg = self.logps / self._tokens().to(self.logps.device)
            log_odds = (avg[0::2] - avg[1::2]) - (_log1mexp(avg[0::2]) - _log1mexp(avg[1::2]))
            ratio, odds = F.logsigmoid(log_odds).sum(), log_odds.sum()
        return [logit_c, logit_r, nll, ratio, odds, mean.new_full((), 1.0 / self.microbatches)]


@dataclass
class LogpRecorder:
    """A forward-only `SequenceLossFn` that records each row's log π (Σ over its label tokens of −CE)."""

    rows: int
    logps: torch.Tensor | None = None

    def __call__(self, token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ce = token_loss.detach().to(torch.float64).reshape(self.rows, -1)
        self.logps = -ce.sum(dim=1)
        return torch.zeros_like(token_loss), torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)


REWARD_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)
"""TRL's DPOTrainer metric names: six means over pairs, then the completions' mean logit per token."""

REWARD_SUMS = 18
"""Entries of `PairLoss.rewards`: the six metrics' sums over pairs, Σ mean logits and tokens of each side, then
CPOTrainer / ORPOTrainer's per-microbatch logits/*, nll_loss, ORPO's two log-odds sums and the microbatches, then
Σ entropy over the completion tokens and Σ top-1 hits over the chosen ones (DPOTrainer's)."""


def reward_metrics(totals: torch.Tensor, pairs: int, rows: int | None = None, style: str = "dpo") -> dict[str, float]:
    """TRL's logged means from the step's [REWARD_SUMS] sums (`PairLoss.rewards`; [microbatches, REWARD_SUMS]:
    each microbatch's, summed here for pairs, KTO's per micro-step: `kto_step_metrics`): per pair, and the logits per
    completion token (DPOTrainer: Σ over the batch's completion tokens of the mean logit / their count), or as
    CPOTrainer / ORPOTrainer (`style` "cpo" / "orpo"): logits/* and nll_loss each replica's, averaged over the
    replicas, ORPO's log_odds_ratio and log_odds_chosen per pair. `rows`: KTO's
    unpaired rows (`kto_metrics`)."""
    if totals.dim() == 2 and rows is not None:  # KTO: each microbatch's metrics, averaged as TRL's micro-steps
        return kto_step_metrics(totals, rows)
    t = (totals.sum(dim=0) if totals.dim() == 2 else totals).tolist()
    if rows is not None:
        return kto_metrics(t, rows)
    out = {name: t[k] / max(pairs, 1) for k, name in enumerate(REWARD_METRICS[:6])}
    if style == "dpo":
        out["logits/chosen"] = t[6] / t[8] if t[8] else 0.0
        out["logits/rejected"] = t[7] / t[9] if t[9] else 0.0
        out["entropy"] = t[16] / (t[8] + t[9]) if t[8] + t[9] else 0.0
        out["mean_token_accuracy"] = t[17] / t[8] if t[8] else 0.0
        return out
    steps = max(t[15], 1e-12)  # the replicas
    out["logits/chosen"], out["logits/rejected"], out["nll_loss"] = t[10] / steps, t[11] / steps, t[12] / steps
    if style == "orpo":
        out["log_odds_ratio"], out["log_odds_chosen"] = t[13] / max(pairs, 1), t[14] / max(pairs, 1)
    return out


def kto_step_metrics(totals: torch.Tensor, rows: int) -> dict[str, float]:
    """KTOTrainer's logged values over a step of microbatches ([microbatches, REWARD_SUMS] sums, each over every
    replica's rows of that microbatch, as its gather_for_metrics): each micro-step's `kto_metrics`, then each
    name's mean over the micro-steps that logged it (rewards/chosen over those with desirable rows, ...)."""
    per = rows // totals.shape[0]
    logged: dict[str, list[float]] = {}
    for t in totals.tolist():
        for name, value in kto_metrics(t, per).items():
            logged.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) for name, values in logged.items()}


def kto_metrics(t: list[float], rows: int) -> dict[str, float]:
    """KTOTrainer's names and means: rewards/ and logps/ of the desirable ("chosen") rows over their count and of
    the undesirable ("rejected") over theirs, each only when the step has such rows, rewards/margins when it has
    both, logits/ per completion token; no accuracy (the trainer adds `kl`)."""
    n_d = t[2]
    n_u = rows - n_d
    out = {}
    if n_d:
        out["rewards/chosen"], out["logps/chosen"] = t[0] / n_d, t[4] / n_d
    if n_u:
        out["rewards/rejected"], out["logps/rejected"] = t[1] / n_u, t[5] / n_u
    if n_d and n_u:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    if t[8]:
        out["logits/chosen"] = t[6] / t[8]
    if t[9]:
        out["logits/rejected"] = t[7] / t[9]
    if t[8] + t[9]:
        out["entropy"] = t[16] / (t[8] + t[9])
    return out
