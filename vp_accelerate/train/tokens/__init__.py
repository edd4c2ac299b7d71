"""Tokenizers and the run's vocabulary: training a byte-level BPE and converting Qwen's BPE (`tokenizer.py`), a
meaning-preserving tokenizer swap (`token_map.py`), and how many embedding / lm_head rows a run has and where each
comes from (`vocab_plan.py`)."""
