"""Preference optimisation (DPO and its IPO / hinge variants) as a loss of whole sequences.

A step's batch holds pairs: row 2k is pair k's chosen completion, row 2k + 1 its rejected one, with the
prompt's labels ignored (-100), so a row's log-probability log π(y|x) is minus the sum of its per-token
cross-entropy. With m = [log π(y_w) − log π_ref(y_w)] − [log π(y_l) − log π_ref(y_l)] TRL's losses are

    sigmoid  −log σ(β·m)          hinge  max(0, 1 − β·m)          ipo  (m − 1/(2β))²

(IPO on length-normalised log-probabilities, as TRL), averaged over the step's P pairs. The loss depends
on the tokens only through each row's CE sum, so dL/dCE_t = −dL/dlog π(row)  (÷ the row's tokens for
IPO) for a completion token and 0 for a prompt token: exactly the per-token g the vocabulary-parallel
output layer takes after C1 (every rank has each token's loss then), so T, ∇x and the pipeline's backward
follow unchanged (vocab/output_layer.py `SequenceLossFn`). The baseline applies the same g to its
autograd CE (runtime/executor.py). A pair's two rows must share a microbatch: microbatches hold an even
number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


@dataclass(frozen=True)
class Preference:
    """What `PipelineModel.train_step` needs to train on preference pairs (its rows interleave chosen and
    rejected: row 2k chosen, row 2k + 1 rejected)."""

    ref_logps: torch.Tensor
    """[batch] the reference model's log π_ref(row) (a sum over the row's label tokens; `sequence_logps`)."""
    beta: float = 0.1
    """β: the strength of the implicit KL penalty (TRL's `beta`)."""
    loss_type: str = "sigmoid"
    """"sigmoid" (DPO), "ipo" or "hinge", as TRL's `loss_type`."""

    def check(self, batch: int, microbatches: int) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if tuple(self.ref_logps.shape) != (batch,):
            raise ValueError(f"ref_logps must be [batch] = [{batch}], got {tuple(self.ref_logps.shape)}")
        if (batch // microbatches) % 2:
            raise ValueError(
                f"a preference batch of {batch} rows in {microbatches} microbatches puts {batch // microbatches} "
                f"rows in each; a pair's chosen and rejected must share a microbatch, so use an even number of "
                f"rows per microbatch (batch = 2 x pairs, pairs a multiple of microbatches)"
            )


def pair_loss(m: torch.Tensor, beta: float, loss_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per pair, dloss/dm per pair) of TRL's `loss_type` at margins m."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * m), -beta * torch.sigmoid(-beta * m)
    if loss_type == "hinge":
        active = (1 - beta * m) > 0  # (a scalar -beta in torch.where would be float32: 4e-8 off in float64)
        return torch.relu(1 - beta * m), -beta * active.to(m.dtype)
    if loss_type == "ipo":
        d = m - 1 / (2 * beta)
        return d**2, 2 * d
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


@dataclass
class PairLoss:
    """One microbatch's preference loss (`vocab.output_layer.SequenceLossFn`); it keeps the rows'
    log-probabilities of its last call for the step's reward metrics."""

    labels: torch.Tensor
    """[rows, seq] shifted labels (-100 at prompt, padding and the last position)."""
    ref_logps: torch.Tensor
    """[rows] float64 log π_ref, sums over each row's label tokens."""
    beta: float
    loss_type: str
    pairs: int
    """P: pairs in the whole step, over every data-parallel replica (the loss is their mean)."""
    loss_scale: float = 1.0
    """fp16's loss scale: g and the loss term carry it, as the token loss's grad_scale does."""
    logps: torch.Tensor | None = field(default=None, repr=False)
    """After a call: [rows] float64 log π of this step's policy (sums over the row's tokens, as TRL logs them)."""
    mean_logits: torch.Tensor | None = field(default=None, repr=False)
    """[rows x seq] each position's logits averaged over the vocabulary (TRL's logits/* metrics), when recorded."""

    wants_mean_logits = True  # the output layer (or the baseline) hands them over: `record_mean_logits`

    def record_mean_logits(self, mean_logits: torch.Tensor) -> None:
        """Keep each position's mean logit over the whole vocabulary (under vocabulary parallelism its sum
        rode on C1's first all-reduce)."""
        self.mean_logits = mean_logits.detach().to(torch.float64).reshape(self.labels.shape)

    def _tokens(self) -> torch.Tensor:
        return (self.labels != -100).sum(dim=1).to(torch.float64).clamp(min=1)

    def normalise(self, logps: torch.Tensor) -> torch.Tensor:
        """TRL's IPO compares average log-probabilities per token; the other losses sums."""
        return logps / self._tokens().to(logps.device) if self.loss_type == "ipo" else logps

    def __call__(self, token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.labels.shape[0]
        ce = token_loss.detach().to(torch.float64).reshape(rows, -1)
        self.logps = -ce.sum(dim=1)
        logps = self.normalise(self.logps)
        ref = self.normalise(self.ref_logps.to(device=ce.device, dtype=torch.float64))
        ratio = logps - ref
        m = ratio[0::2] - ratio[1::2]
        losses, dm = pair_loss(m, self.beta, self.loss_type)
        # dL/dlog π: +dm for the chosen row, −dm for the rejected one; dCE_t = −dL/dlog π (÷ tokens for IPO)
        dlogp = torch.stack([dm, -dm], dim=1).reshape(rows)
        dce = -dlogp / (self._tokens().to(ce.device) if self.loss_type == "ipo" else 1.0)
        valid = self.labels.to(ce.device) != -100
        scale = self.loss_scale / self.pairs
        g = torch.where(valid, (dce * scale)[:, None], 0.0)
        return g.reshape(-1).to(token_loss.dtype), losses.sum() * scale

    def rewards(self) -> torch.Tensor:
        """[REWARD_SUMS] sums over this microbatch's pairs of: chosen reward, rejected reward, chosen > rejected,
        margin, chosen log π, rejected log π; then Σ of the chosen / rejected completions' mean logits and their
        token counts. As TRL logs them: reward = β (log π − log π_ref) of the summed log-probabilities whatever
        the loss (IPO normalises its loss only)."""
        ref = self.ref_logps.to(device=self.logps.device, dtype=torch.float64)
        r = self.beta * (self.logps - ref)
        chosen, rejected = r[0::2], r[1::2]
        valid = (self.labels != -100).to(self.logps.device)
        mean = self.mean_logits if self.mean_logits is not None else torch.zeros(valid.shape, dtype=r.dtype)
        logit_sums = torch.where(valid, mean.to(self.logps.device), 0.0).sum(dim=1)
        tokens = valid.sum(dim=1).to(r.dtype)
        return torch.stack(
            [
                chosen.sum(),
                rejected.sum(),
                (chosen > rejected).to(r.dtype).sum(),
                (chosen - rejected).sum(),
                self.logps[0::2].sum(),
                self.logps[1::2].sum(),
                logit_sums[0::2].sum(),
                logit_sums[1::2].sum(),
                tokens[0::2].sum(),
                tokens[1::2].sum(),
            ]
        )


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

REWARD_SUMS = 10
"""Entries of `PairLoss.rewards`: the six metrics' sums over pairs, Σ mean logits and tokens of each side."""


def reward_metrics(totals: torch.Tensor, pairs: int) -> dict[str, float]:
    """TRL's logged means from the step's [REWARD_SUMS] sums (`PairLoss.rewards`): per pair, and the logits per
    completion token (TRL: Σ over the batch's completion tokens of the mean logit / their count)."""
    t = totals.tolist()
    out = {name: t[k] / max(pairs, 1) for k, name in enumerate(REWARD_METRICS[:6])}
    out["logits/chosen"] = t[6] / t[8] if t[8] else 0.0
    out["logits/rejected"] = t[7] / t[9] if t[9] else 0.0
    return out
