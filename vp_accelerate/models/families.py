"""Which model families can be split, and the check that refuses the others before any work starts.

`check_supported(config)` is what preflight and `PipelineModel` call: it raises
`UnsupportedModelError` naming the missing feature for a family whose forward does something the
stage split cannot reproduce exactly (state that crosses layers, a non-attention layer kind, a loss
term computed over all layers), and otherwise locates the parts on a meta-device model (no memory).
`VERIFIED` (`verified.py`, beside the adapters) lists the families whose loss and every gradient were checked against the HF model on 2
ranks by `coverage.check_families` (docs/models.md is its table; scripts/model_coverage.py rewrites it).
"""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .adapter import ADAPTERS, UnsupportedModelError, find_parts
from .meta import meta_model

#: Families refused, with the feature the stage split lacks.
REFUSED: dict[str, str] = {
    "gemma3n_text": "per-layer inputs and AltUp predictions computed from the token ids outside the decoder layers, "
    "and key/value states shared across layers (they would cross pipeline stages)",
    "gemma4_text": "per-layer inputs computed from the token ids outside the decoder layers and key/value states "
    "shared across layers (they would cross pipeline stages)",
    "gemma4_unified_text": "per-layer inputs computed from the token ids outside the decoder layers and key/value "
    "states shared across layers (they would cross pipeline stages)",
    "hrm_text": "a recurrent reasoning loop over several layer stacks instead of one decoder layer list",
}


def decoder_families() -> list[str]:
    """Every decoder-only causal LM of the installed transformers with a `base_model_pp_plan`, plus adapters."""
    out = []
    for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cls = CONFIG_MAPPING[mt]
        except (KeyError, ImportError):
            continue
        if getattr(cls, "base_model_pp_plan", None) or mt in ADAPTERS:
            out.append(mt)
    return out


def check_supported(config) -> None:
    """Raise `UnsupportedModelError` naming the missing feature if `config`'s model cannot be split exactly.

    Builds the model on the meta device (structure only) to locate its parts; cheap for any size.
    """
    mt = getattr(config, "model_type", None)
    if mt in REFUSED:
        raise UnsupportedModelError(f"model_type {mt!r} is not supported by the pipeline: {REFUSED[mt]}")
    if getattr(config, "output_router_logits", False):
        coef = getattr(config, "router_aux_loss_coef", None)
        raise UnsupportedModelError(
            f"model_type {mt!r} has output_router_logits=True (router_aux_loss_coef={coef}): HF adds a load-balancing "
            "loss computed over the router logits of all layers of the whole batch, which pipeline stages and "
            "microbatches cannot reproduce exactly; set output_router_logits to false (the default of the released "
            "configs) to train without it"
        )
    if getattr(config, "is_heterogeneous", False):
        raise UnsupportedModelError(
            f"model_type {mt!r} is heterogeneous (per-layer attributes "
            f"{sorted(config.per_layer_attributes or ())}: layer shapes vary along the stack), "
            "which the stage split and its cost model do not handle"
        )
    model = meta_model(config)
    parts = find_parts(model)
    names = parts.names
    covered = tuple(
        f"{n}." for n in (names.embed, names.layers, names.norm, names.lm_head, names.pos_embed, names.rotary_emb) if n
    )
    outside = sorted({k.rsplit(".", 1)[0] for k in model.state_dict() if not k.startswith(covered)})
    if outside:
        raise UnsupportedModelError(
            f"model_type {mt!r} has weights outside the input embedding, decoder layers, final norm and output "
            f"layer ({outside[:4]}{' ...' if len(outside) > 4 else ''}): its forward uses modules the stage split "
            "does not place"
        )
    if parts.num_layers != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"model_type {mt!r} has {parts.num_layers} decoder layer modules but num_hidden_layers="
            f"{config.num_hidden_layers} (each module holds several sub-layers); pipeline layouts count "
            "num_hidden_layers, so they would not cover the model"
        )


def unsupported_reason(config) -> str | None:
    """`check_supported`'s message, or None when the family can be split (for callers with their own errors)."""
    try:
        check_supported(config)
    except UnsupportedModelError as e:
        return str(e)
    return None
