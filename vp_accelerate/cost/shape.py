"""Model shape and the FLOP / byte formulas of docs/design.md §1 and §8."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vp_accelerate.model_config import check_model_config, masked_layer_share, read_config_json

# HF model types whose decoder MLP has two matrices (up, down: GPT-2 style). Every other family has a
# gated MLP (gate, up, down: SwiGLU / GeGLU), as nearly every decoder since Llama; a list of the gated
# ones went stale as families were added (Cohere and Granite were counted with two matrices).
# tests/test_cost_shape.py checks this against the modules of every family models/ supports.
UNGATED_MLP_TYPES = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "gptj",
        "gpt_neo",
        "gpt_bigcode",
        "codegen",
        "opt",
        "bloom",
        "falcon",
        "phi",
        "starcoder2",
        "mpt",
        "biogpt",
        "xglm",
        "apertus",
        "apertus1p5_text",
        "arcee",
        "jais2",
        "nemotron",
    }
)


def mlp_matrices(model_type: str) -> int:
    """Weight matrices of one decoder layer's MLP for an HF `model_type`: 2 (up, down) or 3 (gated).
    Without a model type: 2, the paper's formula (ModelShape's default)."""
    return 2 if not model_type or model_type in UNGATED_MLP_TYPES else 3


# HF model types whose attention normalises q and k per head (an RMSNorm over each head's units) before rotary:
# each norm keeps its fp32 input, its normalised output (for its weight's gradient) and rsqrt per head, on top of
# the layer's count. tests/test_cost_shape.py checks this against the modules (a `q_norm` in the attention).
HEAD_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "olmo2", "olmo3", "gemma3_text", "exaone4"})

# HF model types whose decoder layer is GPT-style: nn.LayerNorm (it keeps its input, mean and rstd: no normalised
# copy), one fused q/k/v linear (one cast of the norm's output, where q, k and v each cast their own), and no rotary
# (GPT-2: q, k and v are views of the fused output that SDPA keeps) or rotary on q and k (GPT-NeoX: v's view keeps
# the fused output alive). Measured in the dry run (docs/large_models.md).
LAYER_NORM_TYPES = frozenset({"gpt2", "gpt_neox"})
FUSED_QKV_TYPES = frozenset({"gpt2", "gpt_neox", "phi3"})
NO_ROTARY_TYPES = frozenset({"gpt2"})

# HF model types whose decoder layer normalises each sublayer's output too before the residual add (Gemma-2's
# post_attention_layernorm and post_feedforward_layernorm beside the two pre-norms): two more norms a layer.
SANDWICH_NORM_TYPES = frozenset({"gemma2", "gemma3_text"})

# MLP activations transformers writes as elementwise Python ops, and the [N, ffn] tensors autograd keeps for them
# beyond their input (NewGELUActivation, "gelu_new": tanh's output, 0.5·x and 1 + tanh); torch's own kernels
# (F.gelu, F.silu) keep their input only.
ACTIVATION_EXTRA = {"gelu_new": 3}
DEFAULT_ACTIVATION = {"gpt2": "gelu_new", "gptj": "gelu_new", "codegen": "gelu_new", "phi": "gelu_new"}
"""The activation HF's config class sets for a family when config.json leaves it out (save_pretrained omits it)."""

ATTENTION_KINDS = ("flash", "eager", "sdpa")

# HF model types whose attention has no SDPA path (`_supports_sdpa = False`: Gemma-2's softcapped scores, gpt-oss's
# sinks): HF refuses attn_implementation="sdpa" for them and runs eager by default, with its [b, a, s, s]
# probabilities. tests/test_planner_families.py checks this against the model classes.
NO_SDPA_TYPES = frozenset({"gemma2", "gemma4", "gpt_oss", "vaultgemma", "granite_swa", "granitemoe_swa"})


def default_attention(config) -> str:
    """The attention kernel a GPU run of `config` (an HF config object or a config.json dict) gets when its recipe
    names none, as the dry run and the planner take it: "sdpa", or "eager" for a family without an SDPA path
    (`NO_SDPA_TYPES`)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return "eager" if model_type in NO_SDPA_TYPES else "sdpa"


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a decoder-only transformer and one microbatch."""

    hidden: int
    """Hidden size h."""
    layers: int
    """Transformer layers L."""
    heads: int
    """Attention heads (kept for reporting; the FLOP formula does not need it)."""
    ffn: int
    """MLP intermediate size."""
    vocab: int
    """Vocabulary size V."""
    seq: int
    """Sequence length s."""
    microbatch_size: int = 1
    """Sequences per microbatch b."""
    dtype_bytes: int = 2
    """Bytes per activation / parameter element (2 for bf16)."""
    mlp_matrices: int = 2
    """2 for a GELU MLP (the paper's formula), 3 for a gated (SwiGLU) MLP."""
    tied: bool = False
    """Input embedding and output weight are one tensor."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = `heads`."""
    head_dim: int | None = None
    """Units per attention head when the config sets it apart from hidden / heads (Qwen3-0.6B: 16 x 128 against
    h 1024; Gemma: 256); None = hidden // heads."""
    head_norms: bool = False
    """q and k pass an RMSNorm before rotary (Qwen3, OLMo-2: `HEAD_NORM_TYPES`); their saved tensors are priced."""
    layer_norm: bool = False
    """nn.LayerNorm rather than RMSNorm (`LAYER_NORM_TYPES`): no normalised copy kept, mean and rstd per token."""
    fused_qkv: bool = False
    """One linear makes q, k and v (`FUSED_QKV_TYPES`): the norm's output is cast once for it; with rotary, v is a
    view of its output, which stays alive."""
    rotary: bool = True
    """Rotary position embeddings (False: GPT-2's learned positions: no cos / sin, q and k are views)."""
    sandwich_norms: bool = False
    """Each sublayer's output passes a norm too (`SANDWICH_NORM_TYPES`): 4 norms a layer, not 2."""
    softcap: bool = False
    """Eager attention caps its scores with tanh (Gemma-2's attn_logit_softcapping): tanh's [b, a, s, s] output kept."""
    positions: int = 0
    """Rows of a learned position embedding on the first chunk's rank (GPT-2's wpe: n_positions x h); 0: none."""
    dropout: bool = False
    """Residual dropout in training (GPT-2's resid_pdrop): each layer keeps two [N, h] masks, a byte an element."""
    activation_extra: int = 0
    """[N, ffn] tensors the MLP's activation keeps beyond its input (`ACTIVATION_EXTRA`: 3 for "gelu_new")."""
    attention: str = "flash"
    """How a layer keeps its activations for the backward: "flash" is the paper's setting (a Megatron
    layer with flash attention, Korthikanti et al.'s count); "eager" or "sdpa" is a Hugging Face pre-norm
    decoder layer (RMSNorm, rotary attention) as this project's runtime runs it with that
    `attn_implementation`, counted tensor by tensor."""
    frozen_weights: bool = False
    """The decoder and vocabulary weights get no gradient (a LoRA run): no weight-gradient GEMMs for them
    (W passes and the unsplit backward's ∂W part cost nothing; a rank-r adapter's own are r/h of them)."""
    adapted_mlp: bool = False
    """With `frozen_weights`: LoRA adapters sit on the MLP's linears too (all-linear, gate/up/down targets), so
    the MLP's inputs are kept as in full training; False: adapters on the attention's linears only (peft's
    default q and v), and a frozen MLP keeps neither its normed input nor down_proj's input."""
    tp: int = 1
    """Tensor-parallel ranks a decoder layer is split over (models/tensor_parallel.py): the per-rank figures
    (`rank_layer_params`, the activations, the weight-gradient queue, the GEMM shapes in cost/efficiency.py) are one
    TP rank's; the whole-model FLOPs (`model_flops`, `layer_flops`) stay the model's."""
    sequence_parallel: bool = True
    """With tp > 1: the norms and the residual stream between a stage's layers hold 1/tp of the sequence (the
    runtime's default); False: every TP rank holds them whole."""

    masked_layers: float = 0.0
    """Share of the layers (0 to 1) whose attention gets an explicit [b, 1, s, s] mask: sliding-window layers whose
    window is shorter than the sequence (`model_config.masked_layer_share`; models/masks.py gives a window that
    covers it SDPA's `is_causal`). Under "sdpa" such a layer's backward keeps k and v repeated to every head (HF
    repeats them when a mask is given) and the mask as an additive bias in the compute dtype."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    @property
    def tokens(self) -> int:
        """Tokens per microbatch N = b*s."""
        return self.microbatch_size * self.seq

    @property
    def stream_tokens(self) -> float:
        """Tokens of the residual stream and the norms one TP rank holds: N / tp under sequence parallelism,
        else N."""
        return self.tokens / self.tp if self.tp > 1 and self.sequence_parallel else self.tokens

    # ---- FLOPs per microbatch --------------------------------------------------------------
    def head_size(self) -> int:
        """Units per attention head: `head_dim`, or hidden // heads."""
        return self.head_dim or self.hidden // self.heads

    def q_width(self) -> int:
        """Width of the q projection and of o_proj's input: heads x head size (h unless `head_dim` says otherwise:
        Qwen3-0.6B's q is 2048 wide on h 1024, Gemma-7B's 4096 on 3072)."""
        return self.heads * self.head_size()

    def kv_width(self) -> int:
        """Width of the k and v projections: kv heads x head size (h with plain multi-head attention)."""
        return (self.kv_heads or self.heads) * self.head_size()

    def layer_linear_flops(self) -> float:
        """Forward FLOPs of one layer's weight matmuls: 2N x its weights (`layer_params`): 4Nh^2 (q, o) +
        4N*h*kv_width (k, v; 8Nh^2 for attention in all without grouped-query attention, the paper's
        count) + 2*k*N*h*ffn (MLP)."""
        return 2 * self.tokens * self.layer_params()

    def layer_attention_flops(self) -> float:
        """Forward FLOPs of the attention core (QK^T and AV): 4*b*s^2*h, counted as the paper does (h is the
        heads' width, `q_width`, where `head_dim` sets it apart from the hidden size)."""
        return 4 * self.microbatch_size * self.seq * self.seq * self.q_width()

    def layer_flops(self) -> tuple[float, float, float]:
        """(F, B, W) FLOPs of one layer: B = input gradients (+ attention core backward), W = weight
        gradients; B + W = 2F, so fwd+bwd is s*h*(72h + 12s) at b=1, ffn=4h (docs/design.md §1)."""
        lin, att = self.layer_linear_flops(), self.layer_attention_flops()
        return lin + att, lin + 2 * att, lin

    def output_matmul_flops(self, rows: int | None = None) -> float:
        """One N x h x rows matmul (2*N*h*rows); rows defaults to the whole vocabulary."""
        return 2 * self.tokens * self.hidden * (self.vocab if rows is None else rows)

    def model_flops(self) -> float:
        """Training FLOPs of one microbatch as the paper counts them for MFU (docs/design.md §8):
        3*(2*b*s*h*V + L*(8*b*s*h^2 + 4*b*s^2*h + 2k*b*s*h*FFN)); with grouped-query attention the k and
        v products count at their width (4bsh^2 + 4bsh*kv_width instead of 8bsh^2)."""
        return 3 * (
            self.output_matmul_flops() + self.layers * (self.layer_linear_flops() + self.layer_attention_flops())
        )

    # ---- bytes -----------------------------------------------------------------------------
    def layer_params(self) -> int:
        """Parameters of one layer: attention q and o (h x q_width each: h x h unless `head_dim` is set apart)
        and k and v (h x kv_width each: 4h^2 in all without grouped-query attention) + k*h*ffn MLP (norms and
        biases ignored). Llama-3-70B: 2 x 8192^2 + 2 x 8192 x 1024 + 3 x 8192 x 28672 = 0.856B."""
        h = self.hidden
        return 2 * h * self.q_width() + 2 * h * self.kv_width() + self.mlp_matrices * h * self.ffn

    def rank_layer_params(self) -> float:
        """Parameters of one layer on one TP rank: every matrix of `layer_params` is sliced over tp (q, k, v,
        gate, up by rows, o and down by columns; the norms, ignored here, stay whole)."""
        return self.layer_params() / self.tp

    def layer_activation_bytes(self) -> float:
        """Activations one layer keeps per microbatch for its backward.

        "flash": Korthikanti et al.'s 34*s*b*h bytes in 16-bit at ffn=4h (15*sbh in the attention block,
        19*sbh in the MLP, which we scale by ffn/4h). "eager" / "sdpa": `_hf_layer_elements()` elements.
        """
        if self.attention != "flash":
            masks = 2 * self.stream_tokens * self.hidden if self.dropout else 0  # dropout's bool masks
            return self._hf_layer_elements() * self.dtype_bytes + self._upcast_bytes(norms=2, probs=True) + masks
        sbh = self.tokens * self.hidden
        per = (15 + 19 * self.ffn / (4 * self.hidden)) / self.tp  # Korthikanti et al.'s /t with sequence parallelism
        return sbh * per * self.dtype_bytes / 2 + self._upcast_bytes(norms=2)

    def _upcast_bytes(self, norms: int, probs: bool = False) -> float:
        """What a 16-bit run keeps beyond the 16-bit count: HF's RMSNorm computes in fp32, so each norm keeps
        an fp32 copy of its input (Nh at 4 bytes where the count has 2) and rsqrt (N) in fp32, and each linear
        that reads a norm's fp32 output keeps its own 16-bit cast of it (q, k, v; gate, up); eager attention
        keeps the fp32 softmax [b, a, s, s] besides its 16-bit copy. Nothing in fp32 runs (no copies)."""
        extra = self.stat_bytes - self.dtype_bytes
        if extra <= 0:
            return 0.0
        n = self.tokens
        ns = self.stream_tokens  # a norm runs on the residual stream's tokens (1/tp under sequence parallelism)
        b = norms * (ns * self.hidden + ns) * extra
        if norms == 2 and self.frozen_weights and not self.adapted_mlp:  # LoRA: the adapters' casts (q, v) only
            b += 2 * n * self.hidden * self.dtype_bytes
        elif norms == 2 and self.fused_qkv:
            pass  # one linear reads each norm's output (qkv; up, or Phi-3's fused gate_up): one cast, in the count
        elif norms == 2:  # a layer: autocast casts the norms' fp32 output once per linear that reads it (q, k, v;
            # gate and up), where the count has one 16-bit copy per norm
            b += (2 + (self.mlp_matrices == 3)) * n * self.hidden * self.dtype_bytes
        if norms == 2 and self.head_norms:  # q_norm and k_norm's fp32 input and rsqrt (see _hf_layer_elements)
            kh = self.kv_heads or self.heads
            b += n * (self.heads + kh) / self.tp * (self.head_size() + 1) * extra
        if norms == 2 and self.sandwich_norms:
            # the two output norms: Gemma's RMSNorm keeps its input and its normalised output in fp32 (it scales by
            # 1 + w in fp32, then casts), and rsqrt; nothing reads them as a matmul input
            b += 2 * (2 * ns * self.hidden + ns) * self.stat_bytes
        if probs and self.attention == "eager":
            b += self.microbatch_size * self.heads / self.tp * self.seq * self.seq * self.stat_bytes
        return b

    def _hf_layer_elements(self) -> float:
        """What autograd saves in an HF pre-norm decoder layer (N tokens, a heads of size d, k kv heads):
        each RMSNorm its input, x·rsqrt(var) and the weighted output that feeds the next matmul (3Nh) plus
        rsqrt (N); q after rotary; eager attention k and v repeated to all a heads, the probabilities
        [b, a, s, s] and a contiguous copy of the output for o_proj; sdpa k and v at k heads, the kernel's
        output and its log-sum-exp [b, a, s]; the MLP gate, act(gate), up and their product (gated) or its
        pre-activation and activation (2 matrices). Rotary's cos / sin are per chunk (`chunk_extra_bytes`)."""
        n, h, f, b, s = self.tokens, self.hidden, self.ffn / self.tp, self.microbatch_size, self.seq
        a = self.heads / self.tp  # under tensor parallelism a rank keeps its heads' and MLP columns' share
        qd = a * self.head_size()  # q (and o_proj's input) width: heads x head_dim, which need not be h
        kd = (self.kv_heads or self.heads) / self.tp * self.head_size()
        # each norm's input, x·rsqrt and rsqrt on the stream's tokens (1/tp under sequence parallelism), and the
        # input its linears read (after the sequence all-gather: every token)
        ns = self.stream_tokens
        norms = 2 * (2 * ns * h + ns + n * h)
        if self.layer_norm:  # LayerNorm keeps its input, mean and rstd (its weight's gradient recomputes x̂)
            norms = 2 * (ns * h + 2 * ns + n * h)
        mlp = (4 if self.mlp_matrices == 3 else 2 + self.activation_extra) * n * f
        if self.frozen_weights and not self.adapted_mlp:
            # LoRA (adapters on q and v): autograd saves a matmul's input only for its weight's gradient and a
            # norm's normalised input only for its weight's, so a frozen layer keeps each norm's input and
            # rsqrt, and not the MLP's last product (down_proj's input) or the MLP's normed input (gate, up)
            norms = 2 * (n * h + n)
            mlp = (3 if self.mlp_matrices == 3 else 1) * n * f
        if self.attention == "eager":
            attn = n * qd * 4 + b * a * s * s  # q, k and v repeated, o_proj input; probabilities
            attn += self.softcap * b * a * s * s  # tanh(scores / cap): tanh keeps its output
        else:
            attn = n * qd * 2 + n * kd * 2 + b * a * s  # q, out; k, v; log-sum-exp
            # an explicit mask: k and v saved at all a heads, and SDPA's additive bias [b, 1, s, s] (measured with the
            # dry run: 168 MB a layer for a Mistral-7B shape at b 2, s 4096 with a 2048 window)
            attn += self.masked_layers * (2 * n * (qd - kd) + b * s * s)
        if self.fused_qkv and self.rotary:  # rotary makes new q and k; v's view keeps the fused output (q, k too)
            attn += n * (qd + kd)
        if self.head_norms:
            # q_norm / k_norm (an RMSNorm per head, before rotary): each keeps its input (fp32: `_upcast_bytes`),
            # rsqrt per head, and, for its weight's gradient, its normalised output (not when the weights are frozen)
            kh = (self.kv_heads or self.heads) / self.tp
            attn += (1 if self.frozen_weights else 2) * n * (qd + kd) + n * (a + kh)
        return norms + attn + mlp

    def chunk_extra_bytes(self, last: bool, rotary: bool = True) -> float:
        """Per microbatch and chunk, beyond its layers: rotary cos and sin [b, s, d], and on the chunk that ends
        the model the final norm (3Nh + N; its output is X); "flash" counts only the final norm's fp32 copy."""
        final_norm = self._upcast_bytes(norms=1) if last else 0.0
        if self.attention == "flash":
            return final_norm
        n, h = self.tokens, self.hidden
        cos_sin = 2 * n * self.head_size() if rotary and self.rotary else 0  # not saved when every layer recomputes
        return (cos_sin + (3 * n * h + n if last else 0)) * self.dtype_bytes + final_norm

    @property
    def stat_bytes(self) -> int:
        """Bytes per element of the softmax work (logits, statistics): fp32, or the model's dtype if wider."""
        return max(4, self.dtype_bytes)

    def hidden_bytes(self) -> float:
        """One [N, h] activation tensor (what p2p, C0, IF_REDUCE and IB_BCAST move)."""
        return self.tokens * self.hidden * self.dtype_bytes

    def weight_grad_queue_bytes(self) -> float:
        """What one layer's deferred weight gradients keep from a split backward's B to its W
        (runtime/weight_grad.py): each linear's input and output gradient [N, in] + [N, out] in the compute
        dtype. Under mixed precision every linear casts its own input (q, k and v each a copy of the fp32
        norm's output, gate and up too); in the parameters' dtype the linears that read one tensor share it."""
        t = self.tp  # a TP rank's sliced linears: q, k, v, gate, up give 1/tp of their outputs, o and down read 1/tp
        h, kv, f, n = self.hidden, self.kv_width() / t, self.ffn / t, self.tokens
        q = self.q_width() / t  # q's output and o_proj's input (h unless head_dim sets it apart)
        mlp_in = self.mlp_matrices - 1  # gate and up (or up alone) read the norm's output; down reads [N, ffn]
        if self.dtype_bytes < 4:
            inputs = 3 * h + q + mlp_in * h + f
        else:
            inputs = h + q + h + f
        outputs = q + 2 * kv + h + mlp_in * f + h
        return n * (inputs + outputs) * self.dtype_bytes


def shape_from_hf_config(
    config, seq: int, vocab: int | None = None, microbatch_size: int = 1, dtype_bytes: int = 2, attention: str = "flash"
) -> ModelShape:
    """A ModelShape from an HF config (object, dict, or path to config.json). `vocab` overrides;
    `attention` says how activations are counted (see `ModelShape.attention`). A config whose sizes are not
    integers in range is a ModelConfigError (model_config.py), before anything is sized by it."""
    if isinstance(config, (str, Path)):
        config = read_config_json(config)
    else:
        check_model_config(config)
    get = (
        (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    )
    h = get("hidden_size") or get("n_embd") or get("d_model")
    layers = get("num_hidden_layers") or get("n_layer")
    heads = get("num_attention_heads") or get("n_head")
    if not (h and layers and heads):
        raise ValueError(
            "config lacks hidden_size / num_hidden_layers / num_attention_heads (or GPT-2's n_embd/n_layer/n_head)"
        )
    ffn = get("intermediate_size") or get("n_inner") or 4 * h
    mt = get("model_type", "") or ""
    return ModelShape(
        hidden=h,
        layers=layers,
        heads=heads,
        ffn=ffn,
        vocab=vocab or get("vocab_size"),
        seq=seq,
        microbatch_size=microbatch_size,
        dtype_bytes=dtype_bytes,
        mlp_matrices=mlp_matrices(mt),
        tied=bool(get("tie_word_embeddings", False)),
        kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or None,
        head_norms=mt in HEAD_NORM_TYPES,
        layer_norm=mt in LAYER_NORM_TYPES,
        fused_qkv=mt in FUSED_QKV_TYPES,
        rotary=mt not in NO_ROTARY_TYPES,
        # GPT-2's config class defaults (config.json may leave them out): wpe rows, resid_pdrop 0.1
        positions=(get("n_positions") or 1024) if mt == "gpt2" else 0,
        dropout=bool(get("resid_pdrop", 0.1)) if mt == "gpt2" else False,
        sandwich_norms=mt in SANDWICH_NORM_TYPES,
        softcap=bool(get("attn_logit_softcapping")),
        activation_extra=ACTIVATION_EXTRA.get(
            get("hidden_act") or get("activation_function") or DEFAULT_ACTIVATION.get(mt) or "", 0
        ),
        attention=attention,
        masked_layers=masked_layer_share(config, seq),
    )
