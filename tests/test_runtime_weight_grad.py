import torch
import torch.nn as nn

from vp_accelerate.runtime.weight_grad import WeightGradStore, install


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8, bias=False))


def test_b_then_w_equals_full_backward():
    ref = _mlp().double()
    split = _mlp().double()
    split.load_state_dict(ref.state_dict())
    store = WeightGradStore()
    assert install(split, store) == 2
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    gy = torch.randn(3, 5, 8, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref(xr).backward(gy)
    xs = x.clone().requires_grad_()
    out = split(xs)
    store.key = (0, 0)
    out.backward(gy)
    store.key = None
    # B computed the input gradient and the small parameters, not the linear weights yet
    torch.testing.assert_close(xs.grad, xr.grad)
    assert split[0].weight.grad is None and split[3].weight.grad is None
    torch.testing.assert_close(split[1].weight.grad, ref[1].weight.grad)
    torch.testing.assert_close(split[0].bias.grad, ref[0].bias.grad)
    assert store.pending_bytes() > 0
    store.flush((0, 0))
    for (n, p), (_, q) in zip(split.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
        # a plain tensor, as autograd's own: a graph here would keep the layer's input and ∂y alive
        assert not p.grad.requires_grad and p.grad.grad_fn is None, n
    assert store.pending_bytes() == 0


def test_without_a_key_backward_is_plain():
    m = _mlp()
    install(m, WeightGradStore())
    m(torch.randn(2, 8)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())


def test_w_reaches_the_parameter_under_saved_tensor_hooks():
    # the executor meters activations with saved-tensor hooks; W must still write Parameter.grad
    m = _mlp()
    store = WeightGradStore()
    install(m, store)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = m(torch.randn(2, 8))
    store.key = (0, 0)
    out.sum().backward()
    store.key = None
    store.flush((0, 0))
    assert m[0].weight.grad is not None and m[3].weight.grad is not None


def test_w_adds_a_16bit_gradient_into_the_fp32_grad_without_an_fp32_copy():
    """Under bf16 mixed precision ∂W is a bf16 GEMM; W adds it into the fp32 grad as it is read. Casting it
    first made an fp32 temporary of the weight's size next to it (1.4 GB at a 70B layer's MLP, at the step's
    peak on the ranks whose peak falls in a W pass). The sums are the same bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                self.made.append((func, out.dtype, tuple(out.shape)))
            return out

    torch.manual_seed(0)
    lin = nn.Linear(16, 32, bias=False)
    store = WeightGradStore()
    install(nn.Sequential(lin), store)
    x, gy = torch.randn(2, 5, 16), torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lin(x.requires_grad_())
    store.key = (0, 0)
    out.backward(gy.to(out.dtype))
    store.key = None
    lin.weight.grad = torch.randn(32, 16)  # an earlier microbatch's sum
    (xq, gq, _) = store.queues[(0, 0)][0]
    expected = lin.weight.grad + gq.reshape(-1, 32).t().mm(xq.reshape(-1, 16)).float()
    with Outputs() as seen:
        store.flush((0, 0))
    fp32_copies = [m for m in seen.made if m[1] == torch.float32 and m[2] == (32, 16) and "add_" not in str(m[0])]
    assert fp32_copies == [], fp32_copies
    assert torch.equal(lin.weight.grad, expected)


def test_the_planner_prices_a_layers_weight_gradient_queue_as_the_store_holds_it():
    """ModelShape.weight_grad_queue_bytes (what a split backward keeps from B to W) equals the distinct storage
    bytes an HF Llama layer queues, in fp32 and under bf16 autocast (where q, k, v, gate and up each cast
    their own copy of the norm's fp32 output)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from vp_accelerate.cost.shape import ModelShape

    cfg = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1
    )
    cfg._attn_implementation = "sdpa"
    layer, rotary = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
    store = WeightGradStore()
    install(layer, store)
    n = 24
    for dtype_bytes in (4, 2):
        x = torch.randn(1, n, 64, requires_grad=True)
        pos = torch.arange(n)[None]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_bytes == 2):
            y = layer(x, position_embeddings=rotary(x, pos), attention_mask=None, position_ids=pos)
        y = y[0] if isinstance(y, tuple) else y
        store.key = (0, 0)
        y.backward(torch.randn_like(y))
        store.key = None
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for item in store.queues[(0, 0)]
            for t in item[:2]
        }
        shape = ModelShape(
            hidden=64, layers=1, heads=4, ffn=96, vocab=10, seq=n, mlp_matrices=3, kv_heads=2, dtype_bytes=dtype_bytes
        )
        assert sum(storages.values()) == shape.weight_grad_queue_bytes(), dtype_bytes
        store.flush((0, 0))
