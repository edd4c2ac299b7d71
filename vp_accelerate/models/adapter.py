"""Find the parts of a Hugging Face causal LM that pipeline + vocabulary parallelism moves around.

Most transformers 5.x decoder families declare `config.base_model_pp_plan` (embedding, [input
pieces like dropout], decoder layer list, final norm, in forward order) and `_pp_plan` on the
causal-LM class (the lm_head). We read those, and add the few things a plan does not say:
GPT-2's learned position embeddings, Gemma's √h embedding scale, Granite's embedding multiplier,
Gemma-2's final logit softcapping, Cohere/Granite logit scaling, tied word embeddings, and which
attention mask each layer needs. Families without a plan get a small entry in `ADAPTERS`.

Works on a model built on the meta device (only module structure and the config are read).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

from torch import nn

from ..model_config import layer_kinds
from .masks import MASK_BUILDERS
from .verified import VERIFIED

log = logging.getLogger(__name__)


class UnsupportedModelError(ValueError):
    """The model cannot be split: names the missing part and how to add an adapter."""


@dataclass
class PartNames:
    """Module paths (relative to the causal-LM model) of the parts, for families without a pp plan."""

    embed: str
    """Token embedding, e.g. "transformer.wte"."""
    layers: str
    """nn.ModuleList of decoder layers, e.g. "transformer.h"."""
    norm: str
    """Final norm applied after the last layer, e.g. "transformer.ln_f"."""
    lm_head: str = "lm_head"
    """Output projection [V, h]."""
    pos_embed: str | None = None
    """Learned absolute position embedding added to the token embedding (GPT-2 "transformer.wpe")."""
    embed_dropout: str | None = None
    """Dropout applied to the summed input embedding (GPT-2 "transformer.drop")."""
    rotary_emb: str | None = None
    """Rotary embedding module shared by all layers, if any."""


@dataclass
class ModelParts:
    """The pieces of one causal LM, as live modules of that model, plus their HF names."""

    model_type: str
    """config.model_type."""
    names: PartNames
    """HF module path of each part (state-dict keys are these + ".weight" etc.)."""
    embed: nn.Embedding
    """Token embedding [V, h]."""
    layers: nn.ModuleList
    """Decoder layers in model order."""
    norm: nn.Module
    """Final norm; its output is X, the input of the output layer."""
    lm_head: nn.Linear
    """Output projection [V, h], with a [V] bias in some families (Phi)."""
    rotary_emb: nn.Module | None
    """Rotary embedding (buffers only) or None for absolute-position models."""
    rotary_per_layer_type: bool
    """The rotary embedding takes a layer type (Gemma-3, Olmo-3: other frequencies for sliding layers)."""
    pos_embed: nn.Embedding | None
    """GPT-2 style learned position embedding added after the lookup, or None."""
    embed_dropout: nn.Module | None
    """Dropout on the input embedding (GPT-2 drop, GPT-NeoX emb_dropout), or None."""
    embed_scale: float | None
    """Multiplier on the looked-up embedding (Gemma √h, Granite embedding_multiplier), or None."""
    embed_scale_in_dtype: bool
    """True when HF rounds the scale to the activation dtype before multiplying (Gemma's buffer)."""
    final_softcap: float | None
    """Gemma-2 final_logit_softcapping: logits = cap·tanh(logits/cap), or None."""
    logit_scale: float
    """Multiplier on logits before softcapping (Cohere logit_scale, Granite 1/logits_scaling); 1.0 if none."""
    tied: bool
    """lm_head.weight is the embedding weight."""
    layer_types: tuple[str, ...]
    """Attention-mask kind per decoder layer: "full_attention" or "sliding_attention"."""
    padding_idx: int | None
    """The embedding's padding_idx (its row is zero at init), or None."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def head_bias(self) -> bool:
        """The output projection has a bias (sharded with the rows under vocabulary parallelism)."""
        return self.lm_head.bias is not None


# Families that declare no base_model_pp_plan.
ADAPTERS: dict[str, PartNames] = {
    "gpt2": PartNames(
        embed="transformer.wte",
        layers="transformer.h",
        norm="transformer.ln_f",
        pos_embed="transformer.wpe",
        embed_dropout="transformer.drop",
    ),
}

_HOW_TO_ADD = (
    'To support it, register an adapter: `vp_accelerate.models.adapter.ADAPTERS["{mt}"] = '
    "PartNames(embed=..., layers=..., norm=..., lm_head=..., pos_embed=..., embed_dropout=..., "
    "rotary_emb=...)` with the module paths of {cls}, then check the split against the HF forward "
    "with tests/test_models_equivalence.py."
)


def _unsupported(model: nn.Module, what: str, how_to: bool = True) -> UnsupportedModelError:
    mt = getattr(model.config, "model_type", "?")
    hint = " " + _HOW_TO_ADD.format(mt=mt, cls=type(model).__name__) if how_to else ""
    return UnsupportedModelError(f"cannot split {type(model).__name__} (model_type={mt!r}): {what}.{hint}")


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def _names_from_pp_plan(model: nn.Module) -> PartNames | None:
    """Read the module paths from config.base_model_pp_plan and the causal-LM class's _pp_plan."""
    plan = getattr(model.config, "base_model_pp_plan", None)
    if not plan:
        return None
    prefix = model.base_model_prefix
    keys = list(plan)
    list_keys = [k for k in keys if isinstance(getattr(model.base_model, k, None), nn.ModuleList)]
    if len(list_keys) != 1:
        raise _unsupported(model, f"its base_model_pp_plan {keys} does not name exactly one decoder layer list")
    li = keys.index(list_keys[0])
    before, after = keys[:li], keys[li + 1 :]
    if not before or not isinstance(getattr(model.base_model, before[0]), nn.Embedding):
        raise _unsupported(model, f"no input embedding found first in base_model_pp_plan {keys}")
    extras = before[1:]
    dropout = None
    for k in extras:
        if isinstance(getattr(model.base_model, k), nn.Dropout) and dropout is None:
            dropout = f"{prefix}.{k}"
        else:
            raise _unsupported(model, f"input piece {k!r} of base_model_pp_plan is not a dropout and has no adapter")
    if len(after) != 1:
        raise _unsupported(
            model, f"expected exactly one final norm after the layers in base_model_pp_plan, got {after}"
        )
    head_plan = getattr(type(model), "_pp_plan", None) or {}
    head = next(iter(head_plan), None) or ("lm_head" if hasattr(model, "lm_head") else None)
    if head is None:
        raise _unsupported(model, "no output layer (lm_head) declared in _pp_plan")
    rotary = f"{prefix}.rotary_emb" if hasattr(model.base_model, "rotary_emb") else None
    return PartNames(
        embed=f"{prefix}.{before[0]}",
        layers=f"{prefix}.{list_keys[0]}",
        norm=f"{prefix}.{after[0]}",
        lm_head=head,
        embed_dropout=dropout,
        rotary_emb=rotary,
    )


def _layer_types(config, n: int) -> tuple[str, ...]:
    """Per-layer mask kind, as each family's forward chooses it (model_config.layer_kinds, the planner's rule too)."""
    types = layer_kinds(config, n)
    bad = sorted(set(types) - set(MASK_BUILDERS))  # the kinds with a mask builder are the supported ones
    if bad:
        raise UnsupportedModelError(
            f"layer types {bad} of model_type={config.model_type!r} are not supported "
            f"(supported: {tuple(MASK_BUILDERS)}); add the mask builder to MASK_BUILDERS in models/masks.py"
        )
    return types


def _embed_scale(model: nn.Module, embed: nn.Module) -> tuple[float | None, bool]:
    # Gemma-family scaled embeddings keep the Python float next to a (possibly meta) buffer and
    # multiply by the buffer cast to the weight dtype.
    scale = getattr(embed, "scalar_embed_scale", None)
    if scale is not None:
        return float(scale), True
    mult = getattr(model.config, "embedding_multiplier", None)  # Granite: inputs_embeds * multiplier
    if mult is not None and float(mult) != 1.0:
        return float(mult), False
    return None, False


def _logit_scale(config) -> float:
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    return scale


def find_parts(model: nn.Module) -> ModelParts:
    """Locate embedding, layers, norm, head and model-specific pieces of a causal-LM `PreTrainedModel`.

    Raises `UnsupportedModelError` naming what is missing and how to register an adapter.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model_prefix"):
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers PreTrainedModel with a config")
    mt = config.model_type
    names = ADAPTERS.get(mt) or _names_from_pp_plan(model)
    if names is None:
        raise _unsupported(
            model,
            "it declares no base_model_pp_plan and has no adapter, so the input embedding, "
            "decoder layers and final norm cannot be located",
        )
    try:
        embed, layers, norm, head = (_get(model, n) for n in (names.embed, names.layers, names.norm, names.lm_head))
    except AttributeError as e:
        raise _unsupported(model, f"a part named by its plan/adapter is missing ({e})") from e
    if not isinstance(embed, nn.Embedding):
        raise _unsupported(model, f"input embedding {names.embed} is {type(embed).__name__}, not an nn.Embedding")
    if not isinstance(head, nn.Linear):
        raise _unsupported(model, f"output layer {names.lm_head} is {type(head).__name__}, not an nn.Linear")
    if mt not in VERIFIED:
        log.warning(
            "model_type %r is split from its pp plan but not verified against the HF forward; any extra "
            "logic in its forward outside the layers (scales, masks) would be missed",
            mt,
        )
    rotary = _get(model, names.rotary_emb) if names.rotary_emb else None
    scale, in_dtype = _embed_scale(model, embed)
    cap = getattr(config, "final_logit_softcapping", None)
    in_w, out_w = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return ModelParts(
        model_type=mt,
        names=names,
        embed=embed,
        layers=layers,
        norm=norm,
        lm_head=head,
        rotary_emb=rotary,
        rotary_per_layer_type=rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters,
        pos_embed=_get(model, names.pos_embed) if names.pos_embed else None,
        embed_dropout=_get(model, names.embed_dropout) if names.embed_dropout else None,
        embed_scale=scale,
        embed_scale_in_dtype=in_dtype,
        final_softcap=float(cap) if cap else None,
        logit_scale=_logit_scale(config),
        tied=in_w is out_w,
        layer_types=_layer_types(config, len(layers)),
        padding_idx=embed.padding_idx,
    )
