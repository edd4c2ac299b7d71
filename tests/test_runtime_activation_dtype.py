"""Under bf16 mixed precision the residual stream runs in bf16 between and inside stages: with full activation
checkpointing each layer keeps its input at 2 bytes, and the cost model's bytes (what the planner prices) are
what the runtime holds per rank, within 10%.

Before: the executor widened every received activation to the fp32 parameters' dtype, so each checkpointed
layer input was kept at 4 bytes while the planner priced 2 (about twice the prediction per rank)."""

from __future__ import annotations

import pytest
import torch

from vp_accelerate.distributed import spawn

H, LAYERS, SEQ, VOCAB, MICRO = 128, 4, 64, 256, 4


def _run():
    from transformers import LlamaConfig

    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS, num_attention_heads=4
    )
    config = PipelineConfig(
        schedule="1f1b",
        method="baseline",
        microbatches=MICRO,
        activation_checkpointing="full",
        mixed_precision="bf16",
        attn_implementation="eager",
    )
    pipe = PipelineModel(cfg, config)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    pipe.train_step(ids, ids)
    stats, schedule = pipe.stats(), pipe.schedule
    layers = tuple(end - start for start, end in pipe.layout.chunk_layers)
    pipe.close()
    return stats["peak_activation_bytes"], layers, schedule


def test_bf16_checkpointed_layer_inputs_are_priced_as_the_runtime_keeps_them():
    from vp_accelerate.cost import ModelShape, for_schedule
    from vp_accelerate.sim.simulate import simulate

    per_rank = spawn(_run, 2)
    layers, schedule = per_rank[0][1], per_rank[0][2]
    shape = ModelShape(
        hidden=H,
        layers=LAYERS,
        heads=4,
        ffn=2 * H,
        vocab=VOCAB,
        seq=SEQ,
        dtype_bytes=2,
        mlp_matrices=3,
        kv_heads=4,
        attention="eager",
    )
    sim = simulate(schedule, for_schedule(shape, schedule, chunk_layers=layers, activation_checkpointing="full"))
    for r, (measured, *_) in enumerate(per_rank):
        assert measured == pytest.approx(sim.peak_activation_bytes[r], rel=0.10), r
