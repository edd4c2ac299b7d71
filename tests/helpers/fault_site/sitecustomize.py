"""Put this folder on the PYTHONPATH of a launched job (tests only): every rank a launcher starts (RANK is set)
installs scripts/fault_worker.py's fault from VP_FAULT before its main runs, so a real `vp-accelerate launch
... train` job, whose ranks run `-m vp_accelerate` and not the fault worker, can be given one. The launcher
itself (no RANK) is left alone."""

import os

if os.environ.get("VP_FAULT") and "RANK" in os.environ:
    import importlib.util
    import json

    _path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "scripts", "fault_worker.py")
    _spec = importlib.util.spec_from_file_location("fault_worker", _path)
    _worker = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_worker)
    _worker.install(json.loads(os.environ["VP_FAULT"]))
