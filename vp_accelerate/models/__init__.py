"""Split Hugging Face causal LMs into pipeline stages with full or vocabulary-parallel ends.

adapter  find_parts(model) -> ModelParts (embedding, layers, norm, head, model-specific pieces)
layout   StageLayout: decoder-layer range and owner rank of each chunk
stage    StageChunk (layers of one chunk), FullEmbedding / FullHead (baseline placement)
weights  weight sources: live model, local safetensors checkpoint, seeded init
build    build_rank(source, layout, rank, placement, partition) -> RankModules
rank     RankModules: one rank's chunks and vocabulary pieces, HF-named parameters
export   export_hf: streamed (stream_export) or gathered into one HF state dict and save_pretrained
families check_supported(config): refuse a family the split cannot run exactly; VERIFIED families
coverage tiny config of every decoder family and the 2-rank exactness walk (docs/models.md)
"""

from .adapter import ADAPTERS, ModelParts, PartNames, UnsupportedModelError, find_parts
from .build import build_rank, resolve_config
from .export import assemble_state_dict, export_hf, gather_state_dict, save_hf
from .families import check_supported, decoder_families, unsupported_reason
from .layout import LayoutError, StageLayout, split_counts
from .meta import meta_model
from .rank import RankModules
from .stage import FullEmbedding, FullHead, StageChunk, apply_logit_transforms
from .verified import VERIFIED

__all__ = [
    "ADAPTERS",
    "FullEmbedding",
    "FullHead",
    "LayoutError",
    "ModelParts",
    "PartNames",
    "RankModules",
    "StageChunk",
    "StageLayout",
    "UnsupportedModelError",
    "VERIFIED",
    "apply_logit_transforms",
    "assemble_state_dict",
    "build_rank",
    "check_supported",
    "decoder_families",
    "unsupported_reason",
    "export_hf",
    "find_parts",
    "gather_state_dict",
    "meta_model",
    "resolve_config",
    "save_hf",
    "split_counts",
]
