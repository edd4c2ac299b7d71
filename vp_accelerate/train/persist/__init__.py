"""Checkpoints of a run, and what is made from them: `store.py` (the layout on disk, save and load of each rank's
files, `latest`, keep / keep_best), `writer.py` (a rank's files written in the background), `files.py` (every checkpoint file read and checked), `space.py` (a full disk),
`reshard.py` (a checkpoint into another layout), `resume_check.py` (what `--resume` compares), `hf_export.py` (a
checkpoint or a run's state into an HF model directory and a peft adapter folder), `hub_push.py`
(`checkpoint.push_to_hub`). Below `train/run/`: nothing here imports the run; `run/run_state.py` saves and resumes
a run through these."""
