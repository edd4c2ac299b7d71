"""Moved to `vp_accelerate.cost` (the cost model lives below the runtime); kept so old imports work."""

from vp_accelerate.cost.costs import CostModel, Hardware, MeasuredCosts, even_layer_split  # noqa: F401
from vp_accelerate.cost.layout import StageCosts, for_schedule, redis_layer_split  # noqa: F401
