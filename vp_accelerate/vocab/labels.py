"""The label convention of every loss in the project, in one place.

Labels follow Hugging Face's causal-LM convention: `labels` is aligned with `input_ids` and the
model shifts it, so position t is scored against labels[t + 1] and the last position against
nothing. `model(input_ids, labels=labels)` computes exactly this, so losses match the HF model's.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
"""Label value that contributes no loss (torch's cross_entropy default, HF's convention)."""


def shift_labels(labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, seq] HF-convention labels -> per-position targets: target[:, t] = labels[:, t + 1], the
    last column ignored, and (with an attention mask) positions whose next token is padding ignored."""
    target = torch.full_like(labels, IGNORE_INDEX)
    target[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        target[:, :-1][attention_mask[:, 1:] == 0] = IGNORE_INDEX
    return target
