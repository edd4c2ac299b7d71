"""The preference losses' one table (`LOSSES`: each name and what it needs) and the recipe's `preference` section
as the runtime's own config (`PreferenceConfig`, as `pipeline` is `PipelineConfig`), without torch: the recipe is
checked before anything heavy loads. The formulas are `runtime/preference.py`'s `FORMULAS`, one per entry here.

A loss added to `LOSSES` (and its formula to `FORMULAS`) is a name the recipe accepts: the recipe's type for
`loss_type` is read from the table when a recipe is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union


@dataclass(frozen=True)
class LossKind:
    """One entry of `LOSSES`: what a loss reads and how its per-item values are averaged."""

    reference: bool = True
    """Needs the reference model's log-probabilities."""
    unpaired: bool = False
    """Rows are unpaired (KTO: `Preference.desirable` says which); mean over rows, not pairs."""
    token_mean: bool = False
    """The value is a sum over chosen tokens, averaged by the replica's chosen tokens (`sft`)."""
    trainer: str = "dpo"
    """Whose TRL trainer's pairs and metrics: "dpo" (DPOTrainer, KTOTrainer), "cpo" (CPOTrainer: its own
    tokenization, logits/* over the padded batch, nll_loss) or "orpo" (ORPOTrainer)."""
    averaged: bool = False
    """Its trainer logs logps/* and rewards/* on per-token averages (CPOTrainer's ipo and simpo, ORPOTrainer);
    else on sums (DPOTrainer, IPO included; CPOTrainer's sigmoid and hinge)."""


LOSSES: dict[str, LossKind] = {
    "sigmoid": LossKind(),
    "ipo": LossKind(),
    "hinge": LossKind(),
    "robust": LossKind(),
    "apo_zero": LossKind(),
    "sft": LossKind(reference=False, token_mean=True),
    "simpo": LossKind(reference=False, trainer="cpo", averaged=True),
    "cpo_sigmoid": LossKind(reference=False, trainer="cpo"),
    "cpo_hinge": LossKind(reference=False, trainer="cpo"),
    "cpo_ipo": LossKind(reference=False, trainer="cpo", averaged=True),
    "orpo": LossKind(reference=False, trainer="orpo", averaged=True),
    "kto": LossKind(unpaired=True),
    "apo_zero_unpaired": LossKind(unpaired=True),
}
"""Every preference loss by its TRL `loss_type` name (the last two on data.format: unpaired_preference);
CPOTrainer's sigmoid, hinge and ipo (reference-free, on its pairs) as `cpo_sigmoid`, `cpo_hinge`, `cpo_ipo`."""


def loss_types(loss_type) -> tuple[str, ...]:
    """`loss_type` (one name, or a list or tuple of them; None: none) as a tuple of names."""
    if loss_type is None:
        return ()
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


def alpha_problem(alpha: float, loss_type) -> str | None:
    """Why AlphaPO's `alpha` cannot shape `loss_type` (it shapes CPOTrainer's losses only), or None."""
    types = loss_types(loss_type)
    if alpha and not any(LOSSES[t].trainer == "cpo" for t in types if t in LOSSES):
        return (
            f"{alpha} (AlphaPO) shapes CPOTrainer's losses (simpo, cpo_sigmoid, cpo_hinge, cpo_ipo), and loss_type "
            f"{list(types)} has none; use loss_type: simpo (TRL's alphapo), or alpha: 0"
        )
    return None


def needs_reference(loss_type) -> bool:
    """Some loss of `loss_type` needs the reference model's log-probabilities."""
    return any(LOSSES[t].reference for t in loss_types(loss_type) if t in LOSSES)


@dataclass
class PreferenceConfig:
    """The recipe's `preference` section: DPO (data.format: preference) and KTO (unpaired_preference)."""

    beta: float = 0.1
    """DPO's β (TRL's `beta`): how far the policy may move from the reference model; used with
    data.format: preference, whose loss replaces the token mean."""

    # read from the table when a recipe is read (postponed annotations): a loss added to LOSSES is accepted
    loss_type: Union[Literal[tuple(LOSSES)], list[Literal[tuple(LOSSES)]]] = "sigmoid"
    """TRL's `loss_type`, one name or a list whose losses are summed (with `loss_weights`): `sigmoid` (DPO),
    `ipo` (on length-normalised log-probabilities), `hinge`, `robust` (with `label_smoothing`), `apo_zero`,
    `sft` (the NLL of the chosen completions: RPO / MPO as `[sigmoid, sft]`), `simpo` (CPO's SimPO:
    reference-free, length-normalised, margin `simpo_gamma`), `cpo_sigmoid` / `cpo_hinge` / `cpo_ipo`
    (CPOConfig's loss_type sigmoid / hinge / ipo: reference-free, on CPOTrainer's pairs; its cpo_alpha is
    `[cpo_sigmoid, sft]` with loss_weights `[1, cpo_alpha]`) or `orpo` (ORPO's odds-ratio term: reference-free;
    ORPO is `[sft, orpo]`)."""

    loss_weights: Optional[list[float]] = None
    """One weight per `loss_type` entry (TRL's `loss_weights`); null = 1 each."""

    label_smoothing: float = 0.0
    """ε: the assumed rate of flipped labels for `robust` (in [0, 0.5)), `simpo` and `cpo_sigmoid` (TRL's
    `label_smoothing`)."""

    simpo_gamma: float = 0.5
    """SimPO's target reward margin γ (CPO's `simpo_gamma`); used by `simpo` only."""

    alpha: float = 0.0
    """AlphaPO's reward shape α (CPOConfig's `alpha`): with α ≠ 0 the CPOTrainer losses (`simpo`, `cpo_sigmoid`,
    `cpo_hinge`, `cpo_ipo`) use (1 − π^−α)/α of the log-probabilities they read in place of log π, and log their
    rewards so; 0 = log π. TRL's `loss_type: alphapo` is `simpo` with `alpha` (and no NLL term)."""

    desirable_weight: float = 1.0
    """KTO (`kto`, `apo_zero_unpaired`): the weight of a desirable row's loss (KTOConfig's `desirable_weight`)."""

    undesirable_weight: float = 1.0
    """KTO: the weight of an undesirable row's loss (KTOConfig's `undesirable_weight`)."""

    @property
    def types(self) -> tuple[str, ...]:
        """`loss_type` as a tuple of names."""
        return loss_types(self.loss_type)
