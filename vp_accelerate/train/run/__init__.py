"""A training run: `trainer.py` builds it from a recipe (`setup`) and loops (`train`); `loop.py` holds one step and
what follows it (log, evaluate, save). Beside them: the optimizer (`optim.py`), saving and resuming the run's state
(`run_state.py` over `train/persist/`), NaN/inf handling (`nonfinite.py`), tracking (`tracking.py`), sample
generations (`samples.py`), the final export and its push (`final_export.py`), and how a user error ends every rank (`user_errors.py`)."""
