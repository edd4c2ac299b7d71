"""Moved to `vp_accelerate.cost.shape` (the cost model lives below the runtime); kept so old imports work."""

from vp_accelerate.cost.shape import ATTENTION_KINDS, ModelShape, mlp_matrices, shape_from_hf_config  # noqa: F401
