"""A completed run's final export: its model as an HF directory in `<output_dir>/hf` (and a LoRA run's adapter
folder), then `checkpoint.push_to_hub`. Read from the final checkpoint when the run saves them, else gathered
from the ranks (`persist/hf_export.py` and `runtime/model_io.py` write it).

Read from a checkpoint, the export is written into `hf.tmp` (`adapter.tmp`) and renamed into place once whole,
so `hf/` is there only complete. A run killed before that (a stop signal in its last step whose launcher did
not wait, a crash) leaves its final checkpoint; `--resume` of that finished run trains nothing and writes the
missing export.
"""

from __future__ import annotations

import logging
import os
import shutil

from ..persist.hf_export import export_checkpoint, write_exports
from ..persist.hub_push import push_export
from .run_state import final_checkpoint
from .tracking import gather

log = logging.getLogger("vp_accelerate.train")


TMP = ".tmp"
"""Suffix of an export being written (renamed into place when whole)."""


def exported(out: str, adapter_dir: str | None) -> bool:
    """Whether the final export (and a LoRA run's adapter folder) is in place."""
    return os.path.isdir(out) and (adapter_dir is None or os.path.isdir(adapter_dir))


def export_final(run) -> str | None:
    """A completed run's final model as an HF model dir (safetensors + config + tokenizer) in `<output_dir>/hf`
    (checkpoint.export_hf), merged for a LoRA run, whose adapter folder goes to `<output_dir>/adapter`.

    With checkpoints it is read from the final checkpoint by rank 0; without (checkpoint.enabled: false) the
    ranks gather it (a collective). Returns the model dir, None when not exported.
    """
    recipe, pipe = run.recipe, run.pipe
    c = recipe.checkpoint
    done = run.end_step == recipe.train.steps or getattr(run, "stopped_early", False)  # eval.patience ends it too
    if not (c.export_hf and done):
        return None
    out = os.path.join(recipe.logging.output_dir, "hf")
    adapter = recipe.adapter if recipe.adapter.enabled else None
    adapter_dir = os.path.join(recipe.logging.output_dir, "adapter") if adapter else None
    if run.start_step >= run.end_step:  # a resume of a finished run: export only what is missing
        if not c.dir or exported(out, adapter_dir):
            return out if c.dir else None
        if pipe.rank == 0:
            log.info("the run had finished at step %d but its export is missing: writing it", run.end_step)
    if c.dir:
        if pipe.rank == 0:  # the final checkpoint is the best one with checkpoint.keep_best
            # the run's own recipe (the caller) says whether the model's code may run, not the checkpoint's file
            parts = [(out, out + TMP), *([(adapter_dir, adapter_dir + TMP)] if adapter_dir else [])]
            for _, tmp in parts:
                shutil.rmtree(tmp, ignore_errors=True)  # an export cut short
            export_checkpoint(
                final_checkpoint(run),
                out + TMP,
                adapter_dir=adapter_dir + TMP if adapter_dir else None,
                trust_remote_code=recipe.model.trust_remote_code,
            )
            for final, tmp in reversed(parts):  # the adapter first: hf/ present means the export is whole
                shutil.rmtree(final, ignore_errors=True)  # an earlier export of this output dir
                os.replace(tmp, final)
    elif adapter is None:  # a collective: each pipeline rank of replica 0 writes its own part
        pipe.export_hf(out, run.tokenizer)
    else:
        state = pipe.gather_hf_state_dict()  # collectives: every rank takes part
        transposed = sorted({n for names in gather(list(getattr(pipe, "lora_transposed", []))) for n in names})
        if pipe.rank == 0:
            write_exports(state, pipe.hf_config, run.tokenizer, run.recipe_dict, transposed, out, adapter_dir)
    if pipe.rank == 0:
        merged = (
            " (LoRA merged into the weights; the adapter alone is in " + adapter_dir + ")"
            if adapter_dir
            else " (LoRA merged into the weights)"
            if adapter
            else ""
        )
        log.info(
            "exported the final model to %s%s: AutoModelForCausalLM.from_pretrained / AutoTokenizer, ready "
            "for generate()",
            out,
            merged,
        )
    if pipe.rank == 0 and c.push_to_hub:  # after the export is whole on disk; a failure loses nothing trained
        try:
            push_export(c.push_to_hub, out, adapter_dir, c.hub_private)
        except Exception as e:  # noqa: BLE001 - the hub's errors (HTTP, auth, network) are many; the run is done
            log.error(
                "checkpoint.push_to_hub: pushing to %s failed (%s: %s); the export is in %s: push it with "
                "`huggingface-cli upload %s %s`",
                c.push_to_hub,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                out,
                c.push_to_hub,
                out,
            )
    return out
