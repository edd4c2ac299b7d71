"""The pipeline engine: run any schedule of the IR on real ranks. `PipelineModel` is the public API."""

from vp_accelerate.runtime.pipeline import PipelineConfig, PipelineModel, StepResult

__all__ = ["PipelineConfig", "PipelineModel", "StepResult"]
