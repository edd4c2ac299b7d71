"""vp-accelerate: pipeline-parallel training of HF causal LMs with Vocabulary Parallelism."""

__version__ = "0.1.0"
