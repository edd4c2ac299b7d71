"""One rank of a 2-rank pipeline run that fails on purpose (run by tests/test_runtime_faults.py).

argv: MODE (raise | kill) FAIL_RANK. The failing rank raises inside its chunk's forward, or SIGKILLs
itself, at the second step; the other rank must not hang.
"""

import os
import signal
import sys

import torch
from transformers import LlamaConfig

from vp_accelerate.runtime import PipelineConfig, PipelineModel


def main() -> None:
    mode, fail_rank = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    pipe = PipelineModel(config, PipelineConfig(microbatches=2, watchdog_dead_after_s=5.0))
    ids = torch.randint(0, 128, (2, 16))
    pipe.train_step(ids, ids)
    if pipe.rank == fail_rank:
        chunk = next(iter(pipe.mods.chunks.values()))
        original = chunk.forward

        def failing_forward(*args, **kwargs):
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("injected failure in a chunk forward")

        chunk.forward = failing_forward
        del original
    pipe.train_step(ids, ids)
    print("finished a step that should have failed", flush=True)


if __name__ == "__main__":
    main()
