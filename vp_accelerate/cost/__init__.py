"""The cost model, below the runtime: model shapes and FLOP formulas (shape.py), pass and
communication times and memory (costs.py) with GEMM efficiency by shape and collective chains
(efficiency.py), and stage layouts chosen from them (layout.py).

The simulator (sim/) times schedules with it; the runtime uses it for the balanced ("redis") layer
split and for MFU's FLOP count. Nothing here imports torch.
"""

from .costs import GPU_PRESETS, CostModel, Hardware, MeasuredCosts, even_layer_split
from .layout import (
    StageCosts,
    cost_aware_schedule,
    for_schedule,
    gpu_order,
    layout_costs,
    layout_counts,
    plan_layout,
    redis_layer_split,
)
from .shape import ModelShape, shape_from_hf_config

__all__ = [
    "GPU_PRESETS",
    "CostModel",
    "Hardware",
    "MeasuredCosts",
    "ModelShape",
    "StageCosts",
    "cost_aware_schedule",
    "even_layer_split",
    "gpu_order",
    "layout_counts",
    "for_schedule",
    "layout_costs",
    "plan_layout",
    "redis_layer_split",
    "shape_from_hf_config",
]
