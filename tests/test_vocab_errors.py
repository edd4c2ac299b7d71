"""Bad inputs raise ValueError naming the cause (checked before any collective, so no process group)."""

import pytest
import torch

from vp_accelerate.vocab.embedding import embed_backward, embed_partial
from vp_accelerate.vocab.output_layer import OutputLayerOptions, c2, s_pass, t_pass
from vp_accelerate.vocab.partition import VocabPartition

PART = VocabPartition(10, 2)  # shard_size 5


def _inputs(n=6, h=4, dtype=torch.float32):
    return (
        torch.randn(n, h, dtype=dtype),
        torch.randint(0, 10, (n,)),
        torch.full((n,), 1.0 / n),
        torch.randn(5, h, dtype=dtype),
    )


def test_label_out_of_range_names_position_and_value():
    x, y, g, w = _inputs()
    y[3] = 10
    with pytest.raises(ValueError, match=r"labels at position \(3,\) is 10, outside \[0, 10\)"):
        s_pass(x, y, g, w, PART, 0, OutputLayerOptions())
    y[3] = -7
    with pytest.raises(ValueError, match="is -7"):
        s_pass(x, y, g, w, PART, 1, OutputLayerOptions())
    y[3] = -100  # ignore_index is fine
    s_pass(x, y, g, w, PART, 1, OutputLayerOptions())


def test_input_id_out_of_range():
    ids = torch.tensor([[1, 2], [3, 12]])
    with pytest.raises(ValueError, match=r"input ids at position \(1, 1\) is 12"):
        embed_partial(ids, torch.randn(5, 4), PART, 0)


def test_dtype_errors():
    x, y, g, w = _inputs()
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        s_pass(x.long(), y, g, w, PART, 0, OutputLayerOptions())
    with pytest.raises(ValueError, match="x is torch.float32 but weight is torch.bfloat16"):
        s_pass(x, y, g, w.bfloat16(), PART, 0, OutputLayerOptions())
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        s_pass(x, y.float(), g, w, PART, 0, OutputLayerOptions())
    with pytest.raises(ValueError, match="grad_scale must be float32"):
        s_pass(x, y, g.half(), w, PART, 0, OutputLayerOptions())


def test_shape_errors():
    x, y, g, w = _inputs()
    with pytest.raises(ValueError, match="shard_size is 5"):
        s_pass(x, y, g, torch.randn(6, 4), PART, 0, OutputLayerOptions())
    with pytest.raises(ValueError, match="same h"):
        s_pass(x, y, g, torch.randn(5, 3), PART, 0, OutputLayerOptions())
    with pytest.raises(ValueError, match="x has 6 tokens but labels has 5"):
        s_pass(x, y[:5], g, w, PART, 0, OutputLayerOptions())
    with pytest.raises(ValueError, match="must be \\[\\*ids.shape, h\\]"):
        embed_backward(torch.tensor([1, 2]), torch.randn(3, 4), torch.zeros(5, 4), PART, 0)


def test_options_and_pass_order():
    with pytest.raises(ValueError, match="algorithm must be one of"):
        OutputLayerOptions(algorithm="vocab-3")
    with pytest.raises(ValueError, match="memory must be one of"):
        OutputLayerOptions(memory="offload")
    with pytest.raises(ValueError, match="chunk_size"):
        OutputLayerOptions(chunk_size=0)
    x, y, g, w = _inputs()
    st = s_pass(x, y, g, w, PART, 0, OutputLayerOptions(algorithm="vocab-2"))
    with pytest.raises(RuntimeError, match="wait\\(\\) on c1"):
        t_pass(st, torch.zeros_like(w))
    with pytest.raises(ValueError, match="c2 exists only for vocab-1"):
        c2(st)
