"""Vocabulary-parallel input embedding and output layer (docs/design.md §2-5).

Pass functions for schedules: `output_layer` (C0 broadcast_x, s_pass, c1, t_pass, c2) and `embedding`
(embed_partial, if_reduce, ib_broadcast, embed_backward); one-shot autograd modules in `modules`;
`selftest.main` behind `vp-accelerate selftest`.
"""

from .comm import Pending
from .embedding import embed_backward, embed_partial, ib_broadcast, if_reduce
from .modules import VocabParallelEmbedding, VocabParallelLMHeadLoss
from .output_layer import (
    OutputLayerOptions,
    OutputState,
    broadcast_x,
    c1,
    c2,
    run_output_layer,
    s_pass,
    t_pass,
    token_mean_grad_scale,
)
from .partition import VocabPartition, shard_tensor

__all__ = [
    "Pending",
    "embed_backward",
    "embed_partial",
    "ib_broadcast",
    "if_reduce",
    "VocabParallelEmbedding",
    "VocabParallelLMHeadLoss",
    "OutputLayerOptions",
    "OutputState",
    "broadcast_x",
    "c1",
    "c2",
    "run_output_layer",
    "s_pass",
    "t_pass",
    "token_mean_grad_scale",
    "VocabPartition",
    "shard_tensor",
]
