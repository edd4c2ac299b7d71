"""HF's mask builders across transformers 5.x: the cache is their fourth argument, named `past_key_values` up to
5.2x (5.17, the GPU lease's image) and `cache` later. The stage passes it by position, so either signature runs
(a keyword `cache=` made every step fail on 5.17)."""

from __future__ import annotations

import torch

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn


def _loss_with(cache_by_position_only: bool) -> float:
    """One float64 train_step of a tiny Llama with sliding-window and full layers on one rank; with
    `cache_by_position_only`, HF's builders are wrapped in functions that take the cache by position only, as
    neither 5.17 (`past_key_values`) nor 5.25 (`cache`) takes the other's name."""
    from vp_accelerate.models import masks
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    if cache_by_position_only:
        for kind, real in list(masks.MASK_BUILDERS.items()):

            def renamed(real):
                def build(config, inputs_embeds, attention_mask, *cache, position_ids=None, **kwargs):
                    if kwargs:  # the cache by keyword, under any name, is what 5.17 or 5.25 refuses
                        raise TypeError(
                            f"create_causal_mask() got an unexpected keyword argument {next(iter(kwargs))!r}"
                        )
                    return real(config, inputs_embeds, attention_mask, *cache, position_ids=position_ids)

                return build

            masks.MASK_BUILDERS[kind] = renamed(real)
    config = tiny_llama(64, num_layers=4, hidden_size=32)
    config.layer_types = ["sliding_attention", "full_attention"] * 2
    config.sliding_window = 4
    pipe = PipelineModel(config, PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2), dtype=torch.float64)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    loss = pipe.train_step(ids, ids).loss
    pipe.close()
    return loss


def test_the_stage_passes_the_cache_to_hfs_mask_builders_by_position():
    plain = spawn(_loss_with, 1, False, timeout_s=120)[0]
    positional_only = spawn(_loss_with, 1, True, timeout_s=120)[0]
    assert positional_only == plain
