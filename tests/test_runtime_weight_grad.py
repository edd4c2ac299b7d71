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
