"""The `self` a TRL trainer's loss methods read (DPOTrainer._compute_loss, CPOTrainer / ORPOTrainer's losses),
without building a trainer: the tests call those methods unbound on this stub so TRL's own code is the reference."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch


def trainer_self(**kw) -> SimpleNamespace:
    """A CPU accelerator that gathers nothing, training mode, no auxiliary loss or weighting; `kw` adds the
    trainer's own settings (loss_types, beta, ...)."""
    acc = SimpleNamespace(
        device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x, unwrap_model=lambda m: m
    )
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=acc,
        aux_loss_enabled=False,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        use_weighting=False,
        precompute_ref_logps=True,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        **kw,
    )
