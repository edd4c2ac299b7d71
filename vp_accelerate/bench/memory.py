"""Per-rank peak memory on CPU, from torch's own allocator trace.

The CPU allocator keeps no statistics (there is no torch.cpu.max_memory_allocated), RSS high-water
marks cannot be reset within a process (VmHWM) and include the allocator's cached pages, and counting
autograd-saved tensors would miss state a runtime keeps outside autograd (VP's S->T softmax). So we
run one extra, untimed step under `torch.profiler` with `profile_memory=True`: every allocation and
free by torch on this rank is an event with a signed byte count, and the running sum of those events
is the live tensor memory. Its maximum over the step, above the level at the step's start, is the
step's peak activation memory (saved activations, p2p/collective buffers, and transients such as
the logits and their gradient).

The step is run with the gradients of a previous step still allocated, so gradient accumulation
happens in place and the measured peak is not inflated by first-time gradient allocation:
peak memory = parameter bytes + gradient bytes + peak activation bytes.
"""

from __future__ import annotations

from typing import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_during(fn: Callable[[], object]) -> tuple[int, object]:
    """Run fn() and return (max live bytes above the level at its start, fn's return value)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        out = fn()
    events = [
        e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"
    ]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, out
