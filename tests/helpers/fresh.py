"""What importing some modules drags in, asked of a fresh process.

The process is forked from the fork server of `vp_accelerate.distributed.spawn` (a fresh interpreter where
there is none), so it costs a fraction of a second instead of a new interpreter's torch and transformers
imports. Its fork server has imported `distributed._PRELOAD` already: a module those imports bring in shows
up here too, so a check that a module stays out can fail for a preload, never pass because of one.
"""

from __future__ import annotations

import sys

from vp_accelerate.distributed import spawn


def _imported(modules: list[str], prefix: str) -> list[str]:
    import importlib

    for name in modules:
        importlib.import_module(name)
    return sorted(m for m in sys.modules if m.startswith(prefix))


def imported_after(modules: list[str], prefix: str) -> list[str]:
    """The names in sys.modules that start with `prefix` once a fresh process has imported `modules`."""
    return spawn(_imported, 1, list(modules), prefix, timeout_s=120)[0]
