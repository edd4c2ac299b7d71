"""The pipeline engine: run any schedule of the IR on real ranks. `PipelineModel` is the public API.

`PipelineConfig` and the layout records of `describe()` import without torch (the training recipe
is validated with it before anything heavy loads); `PipelineModel`, `StepResult` and `Preference` load the
engine on first use.
"""

from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.runtime.describe import ChunkLayers, PipelineLayout, RankLayout

__all__ = [
    "AdapterConfig",
    "ChunkLayers",
    "PipelineConfig",
    "PipelineLayout",
    "PipelineModel",
    "Preference",
    "RankLayout",
    "StepResult",
]


def __getattr__(name):
    if name in ("PipelineModel", "StepResult"):
        from vp_accelerate.runtime import pipeline  # torch: loaded on first use (module docstring)

        return getattr(pipeline, name)
    if name == "Preference":
        from vp_accelerate.runtime import preference  # torch: loaded on first use (module docstring)

        return preference.Preference
    raise AttributeError(f"module 'vp_accelerate.runtime' has no attribute {name!r}")
