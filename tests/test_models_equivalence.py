"""Stages run one after another in one process reproduce the HF model's logits and loss (fp32)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from helpers.tiny import FAMILIES, tiny_config
from vp_accelerate.models import StageLayout, build_rank
from vp_accelerate.models.masks import MicrobatchMasks

LAYOUTS = {
    "1f1b-p3": lambda n: StageLayout.one_per_rank(n, 3),
    "vshape-p2": lambda n: StageLayout.v_shape(n, 2),
    "interleaved-p2v2": lambda n: StageLayout.interleaved(n, 2, 2),
    "uneven-redis": lambda n: StageLayout.one_per_rank(n, 3, layer_counts=[1, 2, 1]),
}


def reference(family, attn="eager", **cfg):
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(tiny_config(family, **cfg), attn_implementation=attn).eval()


def random_ids(model, shape=(2, 11)):
    # Fresh ids each run; never the padding id, whose embedding row HF's lookup gives no gradient.
    ids = torch.randint(3, model.config.vocab_size, shape)
    return ids


def run_stages(rms, ids, position_ids=None, attention_mask=None):
    """Embedding -> every chunk in model order (each on its owner's modules) -> head."""
    layout = rms[0].layout
    h = rms[layout.first_rank].embed_tokens(ids)
    for c, owner in enumerate(layout.chunk_rank):
        h = rms[owner].chunks[c](h, position_ids, attention_mask)
    return rms[layout.last_rank].head_logits(h)


def rel_err(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_stages_match_hf_logits_and_loss(family):
    ref = reference(family)
    ids = random_ids(ref)
    with torch.no_grad():
        out = ref(input_ids=ids, labels=ids)
    for name, make in LAYOUTS.items():
        layout = make(ref.config.num_hidden_layers)
        rms = [build_rank(ref, layout, r, "baseline").eval() for r in range(layout.num_ranks)]
        with torch.no_grad():
            logits = run_stages(rms, ids)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        assert rel_err(logits, out.logits) <= 1e-5, (family, name)
        assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item(), (family, name)


@pytest.mark.parametrize(
    "family,attn",
    [
        ("llama", "sdpa"),
        ("gemma2", "eager"),
        ("mistral", "sdpa"),
        ("qwen2", "sdpa"),
        ("gpt2", "eager"),
        ("gpt_neox", "sdpa"),
    ],
)
def test_padding_mask_and_packed_positions(family, attn):
    """A 2D right-padding mask, and packed sequences given by position_ids, give HF's masks per layer."""
    ref = reference(family, attn)
    ids = random_ids(ref, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    layout = StageLayout.v_shape(ref.config.num_hidden_layers, 2)
    rms = [build_rank(ref, layout, r, "baseline").eval() for r in range(2)]
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = run_stages(rms, ids, attention_mask=mask)
        # the runtime's path: the case decided on the host, the mask built there once (models/masks.py)
        host = run_stages(rms, ids, torch.arange(12).repeat(3, 1), MicrobatchMasks(torch.arange(12).repeat(3, 1), mask))
    valid = mask.bool()
    assert rel_err(got[valid], want[valid]) <= 1e-5
    assert torch.equal(host, got)

    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])  # two sequences packed in one row
    with torch.no_grad():
        want = ref(input_ids=ids[:1], position_ids=pos, use_cache=False).logits  # a cache turns packing detection off
        got = run_stages(rms, ids[:1], position_ids=pos)
        masks = MicrobatchMasks(pos, uses=len(layout.chunk_rank))  # one forward per chunk, then let go
        host = run_stages(rms, ids[:1], pos, masks)
    assert rel_err(got, want) <= 1e-5
    assert torch.equal(host, got)
    assert masks.packed and not masks._built

    plain = torch.arange(12).unsqueeze(0)  # one document per row, an all-ones mask: the plain causal case
    with torch.no_grad():
        want = ref(input_ids=ids[:1]).logits
        host = run_stages(rms, ids[:1], plain, MicrobatchMasks(plain, torch.ones(1, 12, dtype=torch.long)))
    assert MicrobatchMasks(plain, torch.ones(1, 12)).plain and MicrobatchMasks(pos).packed
    assert rel_err(host, want) <= 1e-5


def test_stage_gradients_match_hf_baseline_placement():
    """Autograd through the chained stages gives HF's parameter gradients (tied weight on one rank)."""
    ref = reference("gemma2")
    ids = random_ids(ref)
    layout = StageLayout.v_shape(ref.config.num_hidden_layers, 2)  # rank 0 holds embedding and head
    rms = [build_rank(ref, layout, r, "baseline") for r in range(2)]
    for rm in rms:
        rm.eval()
    ref(input_ids=ids, labels=ids).loss.backward()
    logits = run_stages(rms, ids)
    F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    got = {n: p.grad for rm in rms for n, p in rm.named_parameters()}
    assert set(got) == set(want)
    for n in want:
        assert rel_err(got[n], want[n]) <= 1e-5, n


def test_to_keeps_ties_and_named_parameters():
    """.to() may replace Parameters; tied weights stay one tensor and the HF names still cover everything."""
    from vp_accelerate.vocab.partition import VocabPartition

    ref = reference("gemma")
    layout = StageLayout.v_shape(ref.config.num_hidden_layers, 2)
    base = build_rank(ref, layout, 0, "baseline").to(torch.float64)
    assert base.head.weight is base.embed.weight and base.embed.weight.dtype == torch.float64
    vp = build_rank(ref, layout, 1, "vocab", VocabPartition(ref.config.vocab_size, 2)).to(torch.float64)
    assert vp.head_weight is vp.embed_weight and vp.embed_weight.dtype == torch.float64
    names = [n for n, _ in vp.named_parameters()]
    assert len(names) == len(set(names)) and "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert {id(p) for p in vp.parameters()} == {id(p) for p in vp.container.parameters()}


@pytest.mark.parametrize("window", [12, 11])
def test_a_sliding_window_covering_the_row_takes_sdpas_causal_path(window):
    """Mistral's window equal to the row (12 tokens): HF (5.x) builds an explicit mask once the keys reach the
    window, which costs SDPA its flash kernel and makes HF repeat k and v; the stage gives those layers SDPA's
    is_causal (no mask), with HF's logits and gradients, and a padded batch the same values. A window one shorter
    still gets HF's mask."""
    ref = reference("mistral", "sdpa", sliding_window=window).double()
    ids = random_ids(ref, (2, 12))
    layout = StageLayout.v_shape(ref.config.num_hidden_layers, 2)
    rms = [build_rank(ref, layout, r, "baseline").to(torch.float64).eval() for r in range(2)]
    chunk = rms[0].chunks[0]
    plain = MicrobatchMasks(torch.arange(12).repeat(2, 1))
    mask = plain.for_chunk(chunk, torch.empty(2, 12, 0, dtype=torch.float64))["sliding_attention"]
    assert (mask is None) == (window == 12)
    for logits in (ref(input_ids=ids).logits, run_stages(rms, ids, torch.arange(12).repeat(2, 1), plain)):
        # the loss in float64 on both sides (HF's own loss casts the logits to float32)
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    got = {n: p.grad for rm in rms for n, p in rm.named_parameters()}
    for n, p in ref.named_parameters():
        assert rel_err(got[n], p.grad) <= 1e-10, n
    pad = torch.ones_like(ids)
    pad[1, 7:] = 0
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=pad).logits
        host = run_stages(rms, ids, torch.arange(12).repeat(2, 1), MicrobatchMasks(torch.arange(12).repeat(2, 1), pad))
    assert rel_err(host[pad.bool()], want[pad.bool()]) <= 1e-10
