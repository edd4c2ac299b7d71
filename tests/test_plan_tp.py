"""The planner with tensor parallelism: each TP term of the cost model against figures computed by hand (per-rank
parameters and vocabulary rows, the sliced GEMMs' efficiency, the layer's activations under sequence parallelism,
the TP collectives per layer pass, the TP communicator in the reserve), the tp sizes a model and a node allow, a
search that lays out pp x tp x dp, and bad input in one line with exit 2. (None of this existed before: the
planner laid out pp x dp only.)"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from transformers import AutoConfig

from vp_accelerate.cost import GPU_PRESETS, ModelShape
from vp_accelerate.cost.costs import CostModel
from vp_accelerate.cost.efficiency import GemmModel, layer_gemms, tp_collective_time
from vp_accelerate.cost.memory import COMMUNICATOR_BYTES, CONTEXT_BYTES, FRAGMENTATION, communicators, reserve_bytes
from vp_accelerate.schedule.ir import Op
from vp_accelerate.sim.plan import PlanRequest, search, tp_sizes

LLAMA3_70B = ModelShape(
    hidden=8192, layers=80, heads=64, ffn=28672, vocab=128256, seq=4096, mlp_matrices=3, kv_heads=8, attention="sdpa"
)
H100 = GPU_PRESETS["h100"][0]


def _model(shape: ModelShape, pp: int, layers_per_rank: int) -> CostModel:
    return CostModel(shape, "vocab-2", tuple(range(pp)), (layers_per_rank,) * pp, H100, gemm=GemmModel(sms=132))


def test_a_tp_rank_holds_a_tp_th_of_each_layer_and_v_over_pp_tp_vocabulary_rows():
    model = _model(replace(LLAMA3_70B, tp=8), pp=4, layers_per_rank=20)
    # 2 x 8192^2 (q, o) + 2 x 8192 x 1024 (k, v) + 3 x 8192 x 28672 (gate, up, down) = 855,638,016 per layer, / 8
    assert model.shape.rank_layer_params() == 855_638_016 / 8
    assert model.shard_rows == math.ceil(128256 / 32) == 4008  # the vocabulary over pp x tp = 32 ranks
    assert model.rank_params(1) == 20 * 106_954_752 + 2 * 4008 * 8192  # its layers' slices + two shards
    assert model.vocab_ranks == 32  # the vocabulary collectives run over the replica's pp x tp ranks


def test_the_sliced_gemms_run_at_their_own_efficiency():
    shape = replace(LLAMA3_70B, tp=8)
    f = layer_gemms(shape)["F"]
    # q, k, v: 1/8 of (8192 + 2 x 1024) outputs; o reads 1/8 of 8192; gate and up 2 x 28672 / 8; down reads 3584
    assert f[:4] == [(4096, 1280, 8192, 1), (4096, 8192, 1024, 1), (4096, 7168, 8192, 1), (4096, 8192, 3584, 1)]
    assert f[4] == (4096, 4096, 128, 8)  # the scores of the rank's 8 of 64 heads
    gemm = GemmModel(sms=132)
    # 10 x 16 = 160 tiles of 128 x 256 in 2 waves of 132 SMs (160 / 264), K = 8192 against 32 steps of overhead
    assert gemm.efficiency(4096, 1280, 8192) == pytest.approx(160 / 264 * 8192 / 8224, rel=1e-12)
    # the whole q/k/v GEMM: 32 x 40 = 1280 tiles in 10 waves (1280 / 1320)
    assert gemm.efficiency(4096, 10240, 8192) == pytest.approx(1280 / 1320 * 8192 / 8224, rel=1e-12)


def test_tp_collectives_per_layer_pass_on_the_nodes_links():
    shape = replace(LLAMA3_70B, tp=8)
    bw, lat = 450e9, 20e-6
    n = 4096 * 8192
    # sequence parallelism, F: per region an all-gather of the norm's output as the linears' bf16 cast and a
    # reduce-scatter of the bf16 partial sums, each moving 7/8 of the [s, h] tensor per rank; B the conjugates, the
    # input's gradient in fp32
    one_region = 7 / 8 * (2 * n) / bw + 7 / 8 * (2 * n) / bw + 2 * lat
    assert tp_collective_time(shape, bw, lat, "F") == pytest.approx(2 * one_region, rel=1e-12)
    one_region = 7 / 8 * (4 * n) / bw + 7 / 8 * (2 * n) / bw + 2 * lat
    assert tp_collective_time(shape, bw, lat, "B") == pytest.approx(2 * one_region, rel=1e-12)
    # without it: two ring all-reduces (2 x 7/8 of the buffer): F of the bf16 outputs, B of the fp32 input gradients
    plain = replace(shape, sequence_parallel=False)
    assert tp_collective_time(plain, bw, lat, "F") == pytest.approx(2 * (2 * 7 / 8 * 2 * n / bw + lat), rel=1e-12)
    assert tp_collective_time(plain, bw, lat, "B") == pytest.approx(2 * (2 * 7 / 8 * 4 * n / bw + lat), rel=1e-12)
    assert tp_collective_time(LLAMA3_70B, bw, lat) == 0.0
    # a layer pass pays them on top of its compute, not overlapped; W runs none
    tp8, tp1 = _model(shape, 4, 20), _model(LLAMA3_70B, 4, 20)
    tp8_fast = replace(tp8, tp_bandwidth=1e30, hw=replace(H100, latency=0.0))
    assert tp8.pass_time(0, Op.F, 0) - tp8_fast.pass_time(0, Op.F, 0) == pytest.approx(
        20 * tp_collective_time(shape, H100.collective_bandwidth, H100.latency), rel=1e-9
    )
    assert tp8.pass_time(0, Op.W, 0) == tp8_fast.pass_time(0, Op.W, 0)
    # the sliced GEMMs: less than the whole layer's time, more than an eighth of it (smaller tiles, fewer waves)
    assert tp1.pass_time(0, Op.W, 0) / 8 < tp8.pass_time(0, Op.W, 0) < tp1.pass_time(0, Op.W, 0) / 4


def test_a_layers_activations_under_sequence_parallelism_by_hand():
    shape = ModelShape(
        hidden=64, layers=1, heads=4, ffn=128, vocab=100, seq=16, mlp_matrices=3, kv_heads=2, attention="sdpa", tp=2
    )
    # N = 16 tokens, 8 on this rank's residual stream; 2 of 4 heads (q width 32), 1 of 2 kv heads (16), ffn 64
    norms = 2 * (2 * 8 * 64 + 8 + 16 * 64)  # input, x·rsqrt, rsqrt on 8 tokens; the gathered input on 16
    attn = 16 * 32 * 2 + 16 * 16 * 2 + 2 * 16  # q and the output; k and v; the log-sum-exp of 2 heads
    mlp = 4 * 16 * 64  # gate, act(gate), up, their product
    upcast = 2 * (8 * 64 + 8) * 2 + 3 * 16 * 64 * 2  # the norms' fp32 copies (8 tokens); q/k/v's and gate/up's casts
    assert shape.layer_activation_bytes() == (norms + attn + mlp) * 2 + upcast == 27776
    whole = replace(shape, tp=1)  # tp 1: today's count (3Nh + N per norm, every head, the whole MLP)
    assert (
        whole.layer_activation_bytes()
        == (2 * (3 * 16 * 64 + 16) + 16 * 64 * 2 + 16 * 32 * 2 + 4 * 16 + 4 * 16 * 128) * 2
        + 2 * (16 * 64 + 16) * 2
        + 3 * 16 * 64 * 2
    )


def test_the_tp_communicator_is_in_the_reserve():
    assert communicators(4, 1, True, tp=8) == communicators(4, 1, True) + 1 == 4  # world, pipeline, vocabulary, TP
    assert communicators(1, 4, True, tp=8) == 4  # pp 1: the vocabulary group is the TP ranks'
    assert reserve_bytes(50e9, 4, 1, True, tp=8) == pytest.approx(
        CONTEXT_BYTES + 4 * COMMUNICATOR_BYTES + FRAGMENTATION * 50e9
    )


def test_the_tp_sizes_a_model_and_a_node_allow():
    def req(**kw):
        return PlanRequest(**{**dict(gpus=32, memory_gb=80.0, seq=4096, global_batch=32, gpus_per_node=8), **kw})

    config = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80}
    config.update(num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    assert tp_sizes(config, req(), LLAMA3_70B) == (1, 2, 4, 8)
    assert tp_sizes(config, req(gpus_per_node=4), LLAMA3_70B) == (1, 2, 4)  # a stage's TP ranks share a node
    assert tp_sizes(config, req(tensor_parallel=(1, 16)), LLAMA3_70B) == (1,)  # 8 kv heads, a node of 8
    assert tp_sizes(config, req(seq=4098), LLAMA3_70B) == (1, 2)  # sequence parallelism splits the sequence
    assert tp_sizes(config, req(lora_rank=16), LLAMA3_70B) == (
        1,
        2,
        4,
        8,
    )  # LoRA on TP slices (tests/test_plan_tp_end.py)
    assert tp_sizes({**config, "model_type": "gpt2"}, req(), LLAMA3_70B) == (1,)  # no TP plan
    # Phi-3's fused qkv / gate_up split one part at a time (the runtime runs them); OLMo-2's plan, read off its config
    # object too, gathers q/k/v outputs for a norm over all heads, which the runtime refuses
    assert tp_sizes({**config, "model_type": "phi3"}, req(), LLAMA3_70B) == (1, 2, 4, 8)
    olmo2 = AutoConfig.for_model("olmo2", **{k: v for k, v in config.items() if k != "model_type"})
    assert olmo2.base_model_tp_plan and tp_sizes(olmo2, req(), LLAMA3_70B) == (1,)
    assert tp_sizes(config, req(), replace(LLAMA3_70B, kv_heads=2)) == (1, 2)


def test_a_search_lays_out_pp_x_tp_x_dp_with_every_method_tp_runs():
    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8}
    config.update(num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)
    req = PlanRequest(
        gpus=8, memory_gb=80.0, seq=1024, global_batch=16, hardware=H100, gpus_per_node=8,
        schedules=("1f1b",), microbatch_sizes=(2,), checkpointing=("none",), zero=(0,), top=3,
    )  # fmt: skip
    found = search(config, req)
    tps = {p.tp for p in found.plans}
    assert tps == {1, 2, 4, 8}
    for p in found.plans:
        assert p.pp * p.tp * p.dp == 8 and p.microbatches * p.microbatch_size * p.dp == 16
        assert p.tp == 1 or p.method in ("baseline", "redis", "vocab-1", "vocab-2")  # not interlaced
        assert p.pipeline_section()["tp_size"] == p.tp and len(p.peak_memory_gb) == p.pp
    assert found.fitting and all(p.simulated for p in found.fitting[:3])
    assert {p.method for p in found.plans if p.tp > 1 and p.pp > 1} == {"baseline", "redis", "vocab-1", "vocab-2"}


def test_plan_refuses_a_tp_the_node_cannot_hold(tmp_path, capsys):
    import json

    from vp_accelerate.train.cli.plan import plan_main

    path = tmp_path / "config.json"  # a config.json: no transformers to import
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))  # fmt: skip
    args = [str(path), "--gpus", "16", "--gpus-per-node", "8", "--gpu", "h100", "--seq", "64", "--global-batch", "16"]
    assert plan_main(args + ["--tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 3" in err[0] and "--gpus-per-node" in err[0]
    assert plan_main(args + ["--tp", "8"]) == 2  # 4 heads
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp 8" in err[0] and "attention heads (4)" in err[0], err
