"""Training from a recipe on accelerate. Each folder holds one part of a run:

  recipe/   what a recipe contains, which recipes are valid, reading YAML; model presets
  data/     reading data files, tokenizing rows, packing sequences, batching per replica
  tokens/   tokenizers (train, convert, load) and the run's vocabulary decision
  persist/  a checkpoint's files: save, load, reshard, resume checks, the HF export
  run/      the run itself: setup and the step loop, optimizer, tracking, the run's state through persist/
  cli/      the `train`, `export`, `launch`, `plan` and `dryrun` commands and the checks before launch

Dependencies point down this list's reverse: cli -> run -> persist -> tokens -> data -> recipe.
"""
