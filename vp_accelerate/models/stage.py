"""Stage modules: a chunk of decoder layers, and the full embedding / head of the baseline placement.

A `StageChunk` runs decoder layers start..end-1 of one HF model exactly as the model's own forward
does: it builds the attention masks each layer expects with `transformers.masking_utils` (causal,
sliding-window, padding from an optional 2D mask, packed sequences from position_ids) and computes
the rotary position embeddings itself, so nothing but the hidden state travels between stages.
The chunk that starts the model applies the model's input pieces to the raw token-embedding
lookup it is given (GPT-2 position embedding + dropout, Gemma's √h scale); the chunk that ends it
applies the final norm, so its output is X, the input of the output layer.
The runtime hands each chunk a `masks.MicrobatchMasks` instead of a 2D mask: the microbatch's case
(plain, packed, padded) decided on the host, the masks built once per microbatch and never by reading
device values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vp_accelerate import modes

from .adapter import PartNames
from .masks import MicrobatchMasks, mask_builder
from .tensor_parallel import TPSpec, copy_to_region, gather_sequence, slice_sequence, vocab_parallel_embed


def default_position_ids(hidden: torch.Tensor) -> torch.Tensor:
    """0..s-1 for every sequence, shape [1, s], as HF uses when no position_ids are given."""
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class StageChunk(nn.Module):
    """Decoder layers start..end-1 (+ input pieces if chunk 0, + final norm if the last chunk).

    Parameters are named like the HF model's (see `hf_named_parameters`): layer i's weights live in
    `layers[str(i)]`, with i the global layer index.
    """

    def __init__(
        self,
        config,
        names: PartNames,
        chunk: int,
        layer_range: tuple[int, int],
        layers: list[nn.Module],
        layer_types: tuple[str, ...],
        rotary_emb: nn.Module | None,
        norm: nn.Module | None = None,
        pos_embed: nn.Module | None = None,
        embed_dropout: nn.Module | None = None,
        embed_scale: float | None = None,
        embed_scale_in_dtype: bool = False,
        rotary_per_layer_type: bool = False,
    ):
        super().__init__()
        start, end = layer_range
        if len(layers) != end - start:
            raise ValueError(f"chunk {chunk} covers layers {start}..{end - 1} but got {len(layers)} layer modules")
        self.config = config
        self.names = names
        self.chunk = chunk
        self.layer_range = (start, end)
        self.layer_types = tuple(layer_types[start:end])
        self.layers = nn.ModuleDict({str(start + k): layer for k, layer in enumerate(layers)})
        self.rotary_emb = rotary_emb
        self.rotary_per_layer_type = rotary_per_layer_type
        self.norm = norm
        self.pos_embed = pos_embed
        self.embed_dropout = embed_dropout
        self.embed_scale = embed_scale
        self.embed_scale_in_dtype = embed_scale_in_dtype
        self.is_first = chunk == 0  # not start == 0: an empty chunk 0 (balanced split) leaves chunk 1 at layer 0
        self.is_last = norm is not None
        self.checkpointed: frozenset[int] = frozenset()
        """Local indices (0 = the chunk's first layer) of layers whose activations are recomputed in backward."""
        self.on_checkpoint_input = None
        """Called with each checkpointed layer's input, which the checkpoint keeps until backward (the
        runtime's activation meter counts it there: inside the checkpoint nothing else is saved)."""
        self.tp: TPSpec | None = None
        """Tensor parallelism (models/tensor_parallel.py): the layers hold this TP rank's slices; under sequence
        parallelism the chunk keeps 1/tp of the sequence between its first and last layer. None: whole layers."""
        self.tp_sliced: dict[str, int] = {}
        """Local parameter name -> the dim its TP slice was cut along (0 colwise, 1 rowwise)."""
        self.tp_partial: tuple[str, ...] = ()
        """Local names of the parameters whose gradient is a partial sum over the TP group."""
        self.tp_packed: dict[str, list[int]] = {}
        """Local names of fused projections sliced one part at a time -> the parts' whole sizes."""
        self.input_sliced = False
        """Chunk 0 under sequence parallelism fed by the TP-split end-stage embedding (`TPEmbedding`): its input
        holds this rank's 1/tp of the sequence already (the embedding's reduce-scatter). Every other chunk's
        input does under sequence parallelism (the stage before sent its TP rank's part)."""

    def set_activation_checkpointing(self, mode: str) -> None:
        """A key of modes.CHECKPOINTING: "none", "full" (every layer) or "selective" (every other layer:
        local indices 0, 2, 4, ...); ModeError names the valid ones."""
        self.checkpointed = frozenset(modes.checkpointing(mode).layers(len(self.layers)))

    def apply_input_pieces(self, embedded: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Turn the raw token-embedding lookup E[ids] into the first layer's input."""
        h = embedded
        if self.embed_scale is not None:
            # Gemma multiplies by its scale buffer cast to the weight dtype (sqrt(3072) becomes 55.5 in bf16);
            # Granite by a Python float. Same values in fp32, different roundings in bf16.
            scale = torch.tensor(self.embed_scale, dtype=h.dtype) if self.embed_scale_in_dtype else self.embed_scale
            h = h * scale
        if self.pos_embed is not None:
            h = h + self.pos_embed(position_ids)
        if self.embed_dropout is not None:
            h = self.embed_dropout(h)
        return h

    def build_masks(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        kinds: tuple[str, ...] | None = None,
    ) -> dict[str, object]:
        """The masks of the layer types in this chunk (or of `kinds`), as the HF forward builds them (None =
        plain causal), except that a sliding window covering the sequence gets the causal mask (`mask_builder`)."""
        # the cache goes fourth by position: transformers renamed it (`past_key_values` up to 5.2x, then `cache`)
        args = (self.config, hidden, attention_mask, None)
        seq = hidden.shape[1]
        kinds = kinds or sorted(set(self.layer_types))
        return {t: mask_builder(t, self.config, seq)(*args, position_ids=position_ids) for t in kinds}

    def position_embeddings(self, hidden: torch.Tensor, position_ids: torch.Tensor):
        """Rotary (cos, sin) for the layers: one pair, or one per layer type (Gemma-3 / Olmo-3 rotary takes the
        type: sliding layers use other frequencies); None without rotary."""
        if self.rotary_emb is None:
            return None
        if self.rotary_per_layer_type:
            return {t: self.rotary_emb(hidden, position_ids, t) for t in sorted(set(self.layer_types))}
        return self.rotary_emb(hidden, position_ids)

    def forward(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | MicrobatchMasks | None = None,
    ) -> torch.Tensor:
        """hidden [b, s, h] -> hidden [b, s, h].

        For chunk 0, `hidden` is the raw embedding lookup E[ids] (summed over vocabulary shards under
        VP); for the last chunk the output is X (after the final norm). `position_ids` [b or 1, s]
        (default 0..s-1); `attention_mask` an optional 2D [b, s] padding mask (1 = real token), or the
        microbatch's `MicrobatchMasks` (the runtime's: no device reads).
        """
        # under sequence parallelism the input is this rank's 1/tp of the sequence, but for chunk 0 fed the whole
        # embedding output (vocabulary methods, or the baseline without its split embedding)
        sp = self.tp is not None and self.tp.sequence_parallel
        sliced = sp and (self.input_sliced or not self.is_first)
        # the whole sequence's shape (the masks' and rotary tables' builders read shape, dtype and device only)
        whole = hidden.new_empty((hidden.shape[0], hidden.shape[1] * self.tp.comm.size, 0)) if sliced else hidden
        if position_ids is None:
            position_ids = default_position_ids(whole)
        if self.is_first:
            # in the stream's dtype: an fp32 learned-position table (GPT-2's wpe) would widen a bf16 stream to fp32
            # for the whole chunk
            pieces = self.apply_input_pieces(hidden, _own_part(position_ids, self.tp) if sliced else position_ids)
            hidden = pieces.to(hidden.dtype)
        if isinstance(attention_mask, MicrobatchMasks):
            masks = attention_mask.for_chunk(self, whole)
        else:
            masks = self.build_masks(whole, position_ids, attention_mask)
        rope = self.position_embeddings(whole, position_ids)
        if self.tp is not None and not sliced:  # masks and rotary tables stay the whole sequence's
            hidden = slice_sequence(hidden, self.tp)
        for k, (layer, kind) in enumerate(zip(self.layers.values(), self.layer_types)):
            extra = {} if rope is None else {"position_embeddings": rope[kind] if self.rotary_per_layer_type else rope}
            kwargs = dict(attention_mask=masks[kind], position_ids=position_ids, **extra)
            if k in self.checkpointed and torch.is_grad_enabled():
                if self.on_checkpoint_input is not None:
                    self.on_checkpoint_input(hidden)
                # non-reentrant: works with inputs that need no grad, kwargs, and autograd hooks (the B/W split)
                hidden = checkpoint(layer, hidden, use_reentrant=False, **kwargs)
            else:
                hidden = layer(hidden, **kwargs)
        if self.tp is not None and self.is_last:  # the whole sequence before the final norm (a replicated gradient);
            hidden = gather_sequence(hidden, self.tp)  # other chunks send their part on
        if self.norm is not None:
            hidden = self.norm(hidden)
        return hidden

    def hf_name(self, local_name: str) -> str:
        """HF state-dict key of one of this module's parameter/buffer names."""
        head, _, rest = local_name.partition(".")
        if head == "layers":
            return f"{self.names.layers}.{rest}"
        base = {"norm": self.names.norm, "pos_embed": self.names.pos_embed}.get(head)
        if base is None:
            raise KeyError(f"{local_name} has no HF name")
        return f"{base}.{rest}"

    def hf_named_parameters(self):
        """(HF name, parameter) for every parameter of the chunk."""
        for name, p in self.named_parameters():
            yield self.hf_name(name), p

    def hf_named_buffers(self):
        """(HF name, buffer) for every persistent buffer of the chunk (checkpoints hold them; rotary tables are
        non-persistent and recomputed)."""
        params = {name for name, _ in self.named_parameters()}
        for name, t in self.state_dict(keep_vars=True).items():
            if name not in params:
                yield self.hf_name(name), t


def _own_part(position_ids: torch.Tensor, tp: TPSpec) -> torch.Tensor:
    """This TP rank's 1/tp of the sequence of `position_ids` [b or 1, s] (a sliced input's position embedding)."""
    n = position_ids.shape[1] // tp.comm.size
    return position_ids[:, tp.comm.rank * n : (tp.comm.rank + 1) * n]


def apply_logit_transforms(
    logits: torch.Tensor, logit_scale: float = 1.0, softcap: float | None = None
) -> torch.Tensor:
    """Cohere/Granite scaling then Gemma-2 softcapping, in the order HF applies them."""
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


class FullEmbedding(nn.Module):
    """Baseline placement: the whole token embedding on the rank holding chunk 0.

    Returns the raw lookup E[ids]; chunk 0 applies the scale and position pieces. `padding_idx`
    keeps HF's behaviour that the padding row gets no gradient from the lookup.
    """

    def __init__(self, weight: nn.Parameter, padding_idx: int | None):
        super().__init__()
        self.weight = weight
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)


class FullHead(nn.Module):
    """Baseline placement: the whole lm_head (and its bias, if any) on the rank holding the last chunk; X -> logits."""

    def __init__(
        self,
        weight: nn.Parameter,
        logit_scale: float = 1.0,
        softcap: float | None = None,
        bias: nn.Parameter | None = None,
    ):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.logit_scale = logit_scale
        self.softcap = softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_logit_transforms(F.linear(x, self.weight, self.bias), self.logit_scale, self.softcap)


class TPEmbedding(FullEmbedding):
    """Baseline placement under tensor parallelism: this TP rank's rows [start, start + S) of the embedding padded
    to tp x S (Megatron's vocab-parallel embedding, `tensor_parallel.vocab_parallel_embed`): the lookup of ids in
    them, summed over TP (under sequence parallelism reduce-scattered to the rank's 1/tp of the sequence)."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None, tp: TPSpec, start: int, valid: int):
        super().__init__(weight, padding_idx)
        self.tp, self.start, self.valid = tp, start, valid

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embed(ids, self.weight, self.start, self.valid, self.padding_idx, self.tp)


class TPHead(FullHead):
    """Baseline placement under tensor parallelism: the output layer split by columns, this TP rank's vocabulary
    rows [start, start + S) (the first `valid` real); X (whole on every TP rank) -> this rank's logits, X's
    gradient summed over TP backward. The loss is `tensor_parallel.vocab_parallel_cross_entropy`."""

    def __init__(
        self,
        weight: nn.Parameter,
        logit_scale: float,
        softcap: float | None,
        bias: nn.Parameter | None,
        tp: TPSpec,
        start: int,
        valid: int,
    ):
        super().__init__(weight, logit_scale, softcap, bias)
        self.tp, self.start, self.valid = tp, start, valid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(copy_to_region(x, self.tp))
