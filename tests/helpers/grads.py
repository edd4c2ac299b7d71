"""The gradients of a PipelineModel gathered under HF names, as its weights are (vocabulary shards and
tensor-parallel slices joined): one helper for every test that compares gradients with a single-process model."""

from __future__ import annotations

import torch


def gathered_grads(pipe) -> dict[str, torch.Tensor] | None:
    """Every parameter's gradient (zeros where none) by HF name on the replica's first rank, None elsewhere: the
    gradients stand in for the weights for one `gather_hf_state_dict`, then the weights come back."""
    params = pipe.parameters()
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad if p.grad is not None else torch.zeros_like(p.data)
    try:
        return pipe.gather_hf_state_dict()
    finally:
        for p, d in zip(params, saved):
            p.data = d
