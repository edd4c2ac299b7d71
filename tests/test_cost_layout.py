"""plan_layout: the one stage-layout decision shared by PipelineModel and the launch check."""

import pytest

from helpers.fresh import imported_after
from helpers.tiny import tiny_config
from vp_accelerate.cost import plan_layout, redis_layer_split
from vp_accelerate.models.layout import LayoutError
from vp_accelerate.schedule import build_schedule


def _counts(layout):
    return [end - start for start, end in layout.chunk_layers]


def test_even_explicit_and_balanced():
    cfg = tiny_config("llama", num_layers=10, vocab_size=50000, hidden_size=64)
    vhalf = build_schedule("vhalf", "vocab-2", 2, 4)
    even = plan_layout(cfg, vhalf)
    assert _counts(even) == [3, 3, 2, 2] and even.chunk_rank == vhalf.chunk_rank
    explicit = plan_layout(cfg, vhalf, [1, 4, 4, 1])
    assert _counts(explicit) == [1, 4, 4, 1]
    redis = build_schedule("1f1b", "redis", 3, 6)
    balanced = _counts(plan_layout(cfg, redis))
    seq = min(2048, cfg.max_position_embeddings)
    assert tuple(balanced) == redis_layer_split(cfg, 3, seq=seq) and sum(balanced) == 10
    assert balanced != _counts(plan_layout(cfg, build_schedule("1f1b", "baseline", 3, 6)))  # the head costs layers
    assert _counts(plan_layout(cfg, redis, [3, 4, 3])) == [3, 4, 3]  # explicit wins over the cost model


@pytest.mark.parametrize(
    "counts,message",
    [
        ([5, 5], "layers_per_stage \\[5, 5\\] must have 4 entries"),
        ([1, 1, 1, 1], "summing to the model's 10 decoder layers"),
        ([3, 0, 6, 1], "every chunk but the first and the last needs at least one decoder layer"),
    ],
)
def test_bad_explicit_layouts(counts, message):
    cfg = tiny_config("llama", num_layers=10)
    with pytest.raises(LayoutError, match=message):
        plan_layout(cfg, build_schedule("vhalf", "baseline", 2, 4), counts)


def test_too_many_chunks():
    with pytest.raises(LayoutError, match="cannot split 4 decoder layers into 8 chunks"):
        plan_layout(tiny_config("llama", num_layers=4), build_schedule("vhalf", "vocab-2", 4, 4))


def test_runtime_does_not_import_the_simulator():
    assert imported_after(["vp_accelerate.runtime", "vp_accelerate.train.cli.preflight"], "vp_accelerate.sim") == []


def test_end_chunks_may_be_empty():
    """The first and the last chunk still run the vocabulary layers (and the final norm): they may hold no
    decoder layer; an inner chunk may not."""
    cfg = tiny_config("llama", num_layers=10)
    sched = build_schedule("vhalf", "baseline", 2, 4)
    assert _counts(plan_layout(cfg, sched, [0, 5, 4, 1])) == [0, 5, 4, 1]
    assert _counts(plan_layout(cfg, sched, [4, 3, 3, 0])) == [4, 3, 3, 0]


def test_redis_empties_the_last_stage_when_the_output_layer_is_a_stages_worth():
    """The paper's 8-GPU model at seq 4096: the cost model puts 4, 3, 2, 0 decoder layers on the last stage
    at 32k / 64k / 128k / 256k, the paper's reference split."""
    from vp_accelerate.cost import redis_layer_split
    from vp_accelerate.sim.paper import PAPER_REDIS_LAST, shape

    got = {v: redis_layer_split(shape(v, 4096), 8) for v in PAPER_REDIS_LAST}
    assert {v: c[-1] for v, c in got.items()} == PAPER_REDIS_LAST
    assert all(sum(c) == 32 and min(c[1:-1]) >= 1 for c in got.values())
    assert redis_layer_split(shape(256000, 4096), 8, min_end_layers=1)[-1] == 1  # the old floor, on request


def test_runtime_costs_on_cpu_use_the_plain_flop_model():
    """A CPU run orders its passes by CPU-like ratios (no GPU wave quantisation, a costlier softmax)."""
    from vp_accelerate.cost import layout_costs
    from vp_accelerate.schedule.ir import Op

    cfg = tiny_config("llama", num_layers=8, hidden_size=256, vocab_size=32768)  # the benchmark's shape
    sched = build_schedule("vhalf", "vocab-2", 2, 4)
    layout = plan_layout(cfg, sched)
    gpu, cpu = layout_costs(cfg, sched, layout, seq=256), layout_costs(cfg, sched, layout, seq=256, device="cpu")
    assert gpu.gemm is not None and cpu.gemm is None
    # measured on the benchmark's CPU run: T ~ 0.7 S; the GPU model's T is a tenth of its S
    assert (
        cpu.pass_time(0, Op.T, 0) / cpu.pass_time(0, Op.S, 0)
        > 0.4
        > gpu.pass_time(0, Op.T, 0) / gpu.pass_time(0, Op.S, 0)
    )


def test_the_cost_models_even_split_is_the_runtimes():
    from vp_accelerate.cost import even_layer_split
    from vp_accelerate.models.layout import split_counts

    for layers in (1, 5, 16, 80):
        for chunks in range(1, layers + 1):
            assert list(even_layer_split(layers, chunks)) == split_counts(layers, chunks)
    with pytest.raises(ValueError):
        even_layer_split(4, 5)
