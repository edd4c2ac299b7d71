"""The whole causal LM on the meta device: structure and config, no memory. Every module of models/ that needs
the model's structure (the parts, the export's names, the supported-family check) starts from here; it imports
nothing of models/, so none of them has to import `build.py` for it."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM


def meta_model(config, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> nn.Module:
    """The whole causal LM on the meta device: structure and config only, no memory."""
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if dtype == torch.float64:
        # mixture-of-experts layers default to torch's grouped matmul, which has no float64 kernel
        kwargs["experts_implementation"] = "eager"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)
