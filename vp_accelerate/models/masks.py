"""A microbatch's attention masks, decided on the host so that building them never syncs the device.

HF's mask builders (`transformers.masking_utils`) read tensor values to choose a path: with
position_ids and no 2D mask, `find_packed_sequence_indices` runs `.all()` on them (a packed batch?); with
a 2D mask, `_ignore_causal_mask_sdpa` asks whether any token is padding. On a GPU each of those reads
stalls the host until the device has caught up, once per chunk and microbatch. `MicrobatchMasks`
decides on the host, from the caller's host tensors, which of three cases a microbatch is:
- plain (no padding, positions 0..s-1 per document of one per row): the builders get neither the 2D
  mask nor the position ids, so they read nothing (SDPA then runs with `is_causal`);
- packed (positions restart inside a row, no padding): the mask is built once per microbatch by HF's
  own builder on the host tensors (where reading values costs nothing) and moved to the device;
- padded (a 2D mask with zeros): the same, from the 2D mask.
A mask already 4D is returned as-is by HF's builders, so every layer of every chunk uses the one built.

`mask_builder` gives a sliding-window layer whose window covers the whole sequence the causal builder: such a
window masks nothing causality does not, but transformers 5.x builds an explicit mask once the keys reach the
window (`kv_length >= window`, e.g. Mistral-7B's 4096 at seq 4096), which keeps SDPA off its flash kernel and
makes HF repeat k and v to every head. Measured with the dry run, a Mistral-7B shape at seq 4096, b 2: 168 MB a
layer and microbatch (k and v at 32 heads instead of 8, and the mask as an additive bf16 bias, both saved for
the backward).

`MASK_BUILDERS` is the one table of the mask kinds a decoder layer may ask for (`config.layer_types`):
a model with any other kind is refused when its parts are found (models/adapter.py).
"""

from __future__ import annotations

import torch
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
)

MASK_BUILDERS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
"""`config.layer_types` entry -> HF's builder of that layer's mask; the layer types a model may have."""


def mask_builder(kind: str, config, seq: int):
    """HF's builder of a `kind` layer's mask for rows of `seq` tokens: the causal one for a sliding window of at
    least `seq` (the same mask: a key is in the window when query - key < window), else MASK_BUILDERS's."""
    window = getattr(config, "sliding_window", None)
    if kind == "sliding_attention" and window is not None and seq <= window:
        return MASK_BUILDERS["full_attention"]
    return MASK_BUILDERS[kind]


class MicrobatchMasks:
    """The attention-mask inputs of one microbatch, with the case decided on the host."""

    def __init__(self, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, uses: int | None = None):
        """`position_ids` [b, s] and `attention_mask` [b, s] (1 = real token) or None, both on the host;
        `uses`: the chunk forwards that will ask for the masks (this rank's chunks), after which the built
        masks are let go (the layers' autograd graphs keep what their backward needs); None keeps them."""
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # all real tokens: the plain causal mask
        self.attention_mask = attention_mask
        """The host 2D mask when some token is padding, else None."""
        self.position_ids = position_ids
        """The host position ids."""
        self.packed = attention_mask is None and find_packed_sequence_indices(position_ids) is not None
        """Positions restart inside a row (several documents per row), without a 2D mask (HF's rule)."""
        self._built: dict = {}  # (layer type, dtype, device) -> the mask every chunk's layers of that type get
        self._uses_left = uses

    @property
    def plain(self) -> bool:
        """No padding and no packing: the causal mask, built without reading any value."""
        return self.attention_mask is None and not self.packed

    def for_chunk(self, chunk, hidden: torch.Tensor) -> dict[str, object]:
        """The masks of `chunk`'s layer types (StageChunk.build_masks's result), built once per microbatch."""
        out = {}
        for kind in sorted(set(chunk.layer_types)):
            key = (kind, hidden.dtype, hidden.device)
            if key not in self._built:
                if self.plain:  # nothing data-dependent: the builder reads no value
                    self._built[key] = chunk.build_masks(hidden, None, None, kinds=(kind,))[kind]
                else:
                    self._built[key] = build_on_host(self, chunk, kind, hidden)
            out[kind] = self._built[key]
        if self._uses_left is not None:
            self._uses_left -= 1
            if self._uses_left <= 0:  # the rank's last chunk forward of this microbatch: no device copy held on
                self._built.clear()
        return out


def build_on_host(masks: MicrobatchMasks, chunk, kind: str, hidden: torch.Tensor):
    """HF's mask for one layer type, built from the host tensors and moved to `hidden`'s device once."""
    b, s = masks.position_ids.shape
    dummy = torch.empty(b, s, 0, dtype=hidden.dtype)  # the builders read its shape, dtype and device only
    mask = chunk.build_masks(dummy, masks.position_ids, masks.attention_mask, kinds=(kind,))[kind]
    if isinstance(mask, torch.Tensor) and hidden.device.type != "cpu":
        # pinned, so the copy is queued without waiting for the device (a pageable copy would block)
        mask = mask.pin_memory().to(hidden.device, non_blocking=True)
    elif mask is not None and hidden.device.type != "cpu":
        mask = mask.to(hidden.device)  # a flex-attention BlockMask
    return mask
