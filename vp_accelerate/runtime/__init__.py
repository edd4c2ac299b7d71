"""The pipeline engine: run any schedule of the IR on real ranks. `PipelineModel` is the public API.

`PipelineConfig` imports without torch (the training recipe is validated with it before anything
heavy loads); `PipelineModel` and `StepResult` load the engine on first use.
"""

from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig

__all__ = ["AdapterConfig", "PipelineConfig", "PipelineModel", "StepResult"]


def __getattr__(name):
    if name in ("PipelineModel", "StepResult"):
        from vp_accelerate.runtime import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'vp_accelerate.runtime' has no attribute {name!r}")
