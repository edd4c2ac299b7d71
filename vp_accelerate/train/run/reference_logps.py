"""The reference model's log-probabilities of every training pair (DPO), computed once before training.

The reference is the model the run starts from: a forward-only pass of the frozen start weights over the
training pairs (`PipelineModel.sequence_logps`), one number per sequence, kept with the data
(`PairSequences.ref_logps`) and written to `<output_dir>/ref_logps.pt`, so a resumed full fine-tune reads
them rather than scoring with trained weights. Under LoRA the reference is the base with the adapter off,
which a resumed run can compute again. Each replica scores every pair (the set is small; no exchange).
Losses that need no reference (`sft`, `simpo`, `cpo_*`, `orpo` alone) skip the pass: their pairs carry zeros.
KTO's rows (`UnpairedSequences`) are scored with their KL rows (kept as `<split>_kl` in the file).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from vp_accelerate.runtime.preference_config import needs_reference

from ..data.batches import ReplicaShare, Sequences
from ..data.preference import PairSequences
from ..data.unpaired import UnpairedSequences
from ..recipe import RecipeError

log = logging.getLogger("vp_accelerate.train")

FILE = "ref_logps.pt"


def compute(pipe, seqs: PairSequences, pairs_per_batch: int, adapter_off: bool) -> np.ndarray:
    """[2 x pairs] log π_ref of every row, in batches of this replica's shape (the last one filled with pair 0)."""
    out = []
    n = len(seqs)
    for start in range(0, n, pairs_per_batch):
        pairs = np.arange(start, start + pairs_per_batch)
        pairs[pairs >= n] = 0
        b = seqs.batch(pairs)
        logps = pipe.sequence_logps(
            b["input_ids"], b["labels"], b.get("attention_mask"), b.get("position_ids"), adapter_off=adapter_off
        )
        out.append(logps[: 2 * (min(start + pairs_per_batch, n) - start)].numpy())
    return np.concatenate(out).astype(np.float64)


def compute_rows(pipe, seqs: Sequences, rows_per_batch: int, adapter_off: bool) -> np.ndarray:
    """[rows] log π_ref of every row of plain sequences (KTO's rows, or their KL rows), in batches of
    `rows_per_batch` (the last one filled with row 0)."""
    out = []
    n = len(seqs.ids)
    for start in range(0, n, rows_per_batch):
        rows = np.arange(start, start + rows_per_batch)
        rows[rows >= n] = 0
        b = Sequences.batch(seqs, rows)
        logps = pipe.sequence_logps(b["input_ids"], b["labels"], b.get("attention_mask"), adapter_off=adapter_off)
        out.append(logps[: min(start + rows_per_batch, n) - start].numpy())
    return np.concatenate(out).astype(np.float64) if out else np.zeros(0)


def _score(pipe, seqs, per_replica: int, adapter_off: bool) -> None:
    if isinstance(seqs, UnpairedSequences):
        seqs.ref_logps = compute_rows(pipe, seqs, per_replica, adapter_off)
        seqs.ref_kl_logps = compute_rows(pipe, seqs.kl, per_replica, adapter_off)
    else:
        seqs.ref_logps = compute(pipe, seqs, per_replica, adapter_off) if len(seqs) else np.zeros(0)


def _saved(seqs) -> dict:
    if isinstance(seqs, UnpairedSequences):
        return {"": seqs.ref_logps, "_kl": seqs.ref_kl_logps}
    return {"": seqs.ref_logps}


def attach(run, resuming: bool) -> None:
    """Set `ref_logps` of the run's training and evaluation pairs (computed, or read back on a resume of a full
    fine-tune)."""
    data, recipe, pipe = run.data, run.recipe, run.pipe
    kinds = (PairSequences, UnpairedSequences)
    splits = {k: v for k, v in (("train", data.train), ("eval", data.eval)) if isinstance(v, kinds)}
    if not splits:
        return
    types = recipe.preference.loss_type
    if not needs_reference(types):
        for seqs in splits.values():  # reference-free: the batches still carry the (unused) column
            seqs.ref_logps = np.zeros(len(seqs.ids))
        log.info("DPO: loss_type %s needs no reference model: no reference pass", types)
        return
    path = os.path.join(recipe.logging.output_dir, FILE)
    lora = recipe.adapter.enabled
    if resuming and not lora:
        if not os.path.exists(path):
            raise RecipeError(
                f"logging.output_dir: {path} is missing: a resumed DPO run needs the reference log-probabilities its "
                f"start computed; start the run again, or train with an adapter (its base is the reference)"
            )
        saved = torch.load(path, weights_only=True, map_location="cpu")
        for name, seqs in splits.items():
            group = saved.get(name + "_kl_group")
            if isinstance(seqs, UnpairedSequences) and (group is None or int(group) != seqs.chunk):
                raise RecipeError(
                    f"{path}: its KTO KL rows were built for microbatches of {None if group is None else int(group)} "
                    f"rows, this run's have {seqs.chunk}: keep train.global_batch, pipeline.microbatches and "
                    f"dp_size as the run started, or start the run again"
                )
            for suffix in _saved(seqs):
                ref = saved.get(name + suffix)
                if ref is None or ref.shape != (len(seqs.ids),):
                    raise RecipeError(
                        f"{path}: no {name + suffix} values for its {len(seqs.ids)} sequences; the data changed"
                    )
                setattr(seqs, "ref_kl_logps" if suffix else "ref_logps", ref.numpy())
        return
    per_replica = ReplicaShare(recipe.train.global_batch, pipe.dp_rank, pipe.dp_size).per_replica  # pairs, KTO's rows
    for seqs in splits.values():
        _score(pipe, seqs, per_replica, adapter_off=lora)
    if run.accelerator.is_main_process:
        os.makedirs(recipe.logging.output_dir, exist_ok=True)
        saved = {name + k: torch.from_numpy(v) for name, seqs in splits.items() for k, v in _saved(seqs).items()}
        for name, seqs in splits.items():  # KTO: the KL rows depend on the microbatch size
            if isinstance(seqs, UnpairedSequences):
                saved[name + "_kl_group"] = torch.tensor(seqs.chunk)
        torch.save(saved, path)
        log.info("DPO: reference log-probabilities of %d training pairs -> %s", len(splits["train"]), path)
