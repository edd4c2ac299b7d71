"""A checkpoint into HF model directories: `vp-accelerate export CHECKPOINT` and the final export of `train`
(`run/final_export.py`); the streamed-or-gathered choice is `models/export.export_hf`'s.

From a checkpoint (per-rank shards, read in one process): the first data-parallel replica's ranks hold every
tensor once; vocabulary shards are concatenated in pipeline-rank order and cut to `vocab_size` rows, tensors
duplicated across ranks (the baseline's tied embedding copy) are taken once. Without checkpoints
(`checkpoint.enabled: false`) the final export gathers the same state dict from the ranks instead.

Every export ships the run's tokenizer (with the chat template it trained with) and writes its bos/eos/pad
ids into config.json and generation_config.json, where generation also stops at the template's end-of-turn
token (`models/generation.py`), so `generate()` works on it as it is.

A LoRA run's state holds the frozen base weights and the adapters: the model directory is merged (W +
alpha/r·BA, a plain HF model); the peft adapter folder (`adapter_dir`, or `adapter_only`) holds the adapters,
the tokenizer and `base_model_name_or_path`, never a path of the training machine: the model's hub id when
the run's frozen base is exactly that model (model.source a hub id, or a directory of the hub's cache), else
the frozen base itself, written into `<adapter>/base` and named `base`, relative to the folder — a fresh
model, a local directory, config overrides, other special-token ids. So the folder loads wherever it is copied:
`AutoPeftModelForCausalLM.from_pretrained(".")` inside it (peft resolves the name from the working directory),
or `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("adapter/base"), "adapter")` from anywhere.
A hub model whose vocabulary the run resized (to the tokenizer, new rows grown) or rebuilt (a swapped
tokenizer) is still named by its hub id, since no relative name loads from every working directory: the folder
then carries the run's embedding and output layer whole (peft's `modules_to_save`), which
`AutoPeftModelForCausalLM.from_pretrained(folder)` puts over the hub model it first resizes to the folder's
tokenizer — from any directory, the same weights as the merged export.
"""

from __future__ import annotations

import logging
import os

from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from vp_accelerate.models.export import assemble_state_dict, export_hf, save_hf
from vp_accelerate.models.generation import generation_eos
from vp_accelerate.models.lora import merge_lora, save_adapter
from vp_accelerate.models.stream_export import TPLayout, export_rank_files
from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.safetensors_file import UnreadableSafetensors

from ..recipe.convert import from_dict
from ..recipe.presets import starts_from_weights
from ..tokens.token_map import same_vocabulary
from . import store as ckpt

log = logging.getLogger("vp_accelerate.train")


def _adapter_of(recipe, where: str = "meta.json"):
    """The run's AdapterConfig when it trained LoRA adapters, else None. `recipe`: the recipe meta.json saved, read
    as a recipe is (unknown keys, types, values): CheckpointError naming `where` (meta.json) and the key."""
    if recipe is not None and not isinstance(recipe, dict):
        raise ckpt.CheckpointError(
            f"checkpoint file {where}: `recipe` is {type(recipe).__name__}, not the run's recipe"
        )
    section = (recipe or {}).get("adapter") or {}
    try:
        adapter = from_dict(AdapterConfig, section, "recipe.adapter").check() if section else AdapterConfig()
    except ValueError as e:  # RecipeError: an unknown key (a did-you-mean), a wrong type; or an impossible value
        raise ckpt.CheckpointError(
            f"checkpoint file {where}: {e} (altered, or written by another version of vp-accelerate); "
            f"{ckpt.files.fix(where)}"
        ) from None
    return adapter if adapter.enabled else None


def replica0_files(path: str, meta: dict) -> list[tuple[str, frozenset[str]]]:
    """(model.safetensors of each rank of data-parallel replica 0, in pipeline order; names it holds as a copy
    another rank counts) of checkpoint `path`."""
    # vocabulary-rank order (pipeline order, then a stage's tensor-parallel ranks)
    replica0 = sorted(
        (r for r in meta["ranks"] if r["dp_rank"] == 0), key=lambda r: (r["pp_rank"], r.get("tp_rank", 0))
    )
    if not replica0:
        raise ckpt.CheckpointError(f"{path}: meta.json lists no ranks of data-parallel replica 0")
    for r in replica0:  # every file whole and unchanged since the save, before the export writes anything
        ckpt.check_weight_file(path, r["rank"])
    return [
        (os.path.join(path, ckpt.rank_dir_name(r["rank"]), "model.safetensors"), frozenset(r.get("duplicates", ())))
        for r in replica0
    ]


def checkpoint_model_files(path: str, trust_remote_code: bool = False):
    """(config, tokenizer, meta) of checkpoint `path` (a step dir).

    `trust_remote_code` comes from the caller only (`export --trust-remote-code`, the run's own recipe for its
    final export), never from the checkpoint: a shared checkpoint folder whose meta.json says so, with an
    `auto_map` and a `configuration_*.py` in model/, would otherwise run its code here."""
    meta = ckpt.read_meta(path)
    ckpt.check_model_files(path, meta)
    model_dir = os.path.join(path, "model")
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ckpt.CheckpointError(
            f"{model_dir} holds a model with its own Python code (auto_map in config.json); export runs it only "
            f"when asked: if you trust where this checkpoint came from, add --trust-remote-code"
        ) from None
    saved = meta.get("vocab_size", getattr(config, "vocab_size", None))
    if saved != getattr(config, "vocab_size", saved):  # the vocabulary matrices are sized by it: never trust it alone
        raise ckpt.CheckpointError(
            f"checkpoint file {os.path.join(path, 'meta.json')}: vocab_size {saved} differs from model/config.json's "
            f"{config.vocab_size}; the checkpoint is damaged or was altered: {ckpt.files.fix(os.path.join(path, 'meta.json'))}"
        )
    return config, tokenizer, meta


def tp_layout(meta: dict) -> TPLayout:
    """How checkpoint meta.json says the replica's tensors are split over tensor parallelism."""
    size = int(meta.get("tp_size", 1))
    if size == 1:
        return TPLayout()
    sliced, packed = dict(meta.get("tp_sliced", {})), dict(meta.get("tp_packed", {}))
    return TPLayout(size, sliced, packed, frozenset(meta.get("tp_vocab", ())))


def checkpoint_state(path: str, trust_remote_code: bool = False):
    """(full HF state dict, config, tokenizer, meta) of checkpoint `path` (a step dir or a checkpoint root),
    the whole model in memory: for LoRA merges (a full model export streams: `export_checkpoint`).
    `trust_remote_code`: the caller's word (see `checkpoint_model_files`)."""
    path = ckpt.resolve(path)
    config, tokenizer, meta = checkpoint_model_files(path, trust_remote_code)
    shards = []
    for file, skip in replica0_files(path, meta):
        shards.append({k: v for k, v in ckpt.files.load_safetensors(file).items() if k not in skip})
    tp = int(meta.get("tp_size", 1)) > 1
    tp_sliced, tp_packed = (dict(meta.get("tp_sliced", {})), dict(meta.get("tp_packed", {}))) if tp else ({}, {})
    tp_vocab = frozenset(meta.get("tp_vocab", ())) if tp else frozenset()
    state = assemble_state_dict(
        shards, meta["vocab_size"], frozenset(meta.get("sharded_names", ())), tp_sliced, tp_packed, tp_vocab
    )
    return state, config, tokenizer, meta


def _ids(x) -> list:
    """A generation config's eos_token_id (an id, a list, None) as a sorted list."""
    return sorted(x) if isinstance(x, list) else ([] if x is None else [x])


def cached_hub_id(path: str) -> str | None:
    """The hub id of a directory in the hub's cache (`.../models--org--name/snapshots/<revision>`), else None."""
    parts = os.path.abspath(path).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/", 1)
    return None


BASE_DIR = "base"
"""Where an adapter folder keeps a frozen base that exists nowhere else, and the relative
`base_model_name_or_path` that names it (relative to the folder: it loads wherever the folder is copied)."""


def adapter_base(recipe: dict, vocab_size: int, tokenizer) -> tuple[str | None, str, bool]:
    """(what the adapter folder names as its base model, why, whether the folder carries the vocabulary): the
    model source's hub id when the run's frozen base is exactly that model with this tokenizer's ids (False), or
    that model but for a vocabulary peft can put back (True: rows grown to the tokenizer, which
    AutoPeftModelForCausalLM resizes the base to, or as many rows as the model's); else None (the base is written
    beside the adapter)."""
    m = (recipe or {}).get("model") or {}
    source = m.get("source")
    if not source or not starts_from_weights(source, m.get("pretrained_weights", True)):
        return None, "the run started from a fresh model, which exists nowhere else", False
    if m.get("config") or m.get("init_from"):
        return None, "model.config / model.init_from: the run's base is not model.source's weights", False
    if tokenizer is None:
        return None, "no tokenizer to compare with the model's", False
    local = os.path.expanduser(source)
    if not os.path.isdir(local) and (source.startswith((".", "/", "~")) or source.count("/") != 1):
        return None, f"model.source {source!r} is not a directory here", False
    hub_id = cached_hub_id(local) if os.path.isdir(local) else source
    if hub_id is None:  # a path on this machine would not load where the folder is copied to
        return None, f"model.source {source!r} is a directory on this machine, not a hub id", False
    where = os.path.abspath(local) if os.path.isdir(local) else source
    try:
        rows = AutoConfig.from_pretrained(where).vocab_size
        stops = GenerationConfig.from_pretrained(where).eos_token_id
        if _ids(stops) != _ids(generation_eos(tokenizer)):
            why = f"{where} stops generation at {stops}, the run's tokenizer at {generation_eos(tokenizer)}"
            return None, why, False
        if rows == vocab_size and same_vocabulary(AutoTokenizer.from_pretrained(where), tokenizer):
            return hub_id, f"the frozen base is {hub_id}", False
    except (OSError, ValueError) as e:
        return None, f"cannot read {where} offline ({type(e).__name__})", False
    # AutoPeftModelForCausalLM grows the base's rows to len(tokenizer) (never shrinks), then loads modules_to_save
    if vocab_size == rows >= len(tokenizer) or vocab_size == len(tokenizer) > rows:
        return hub_id, f"the frozen base is {hub_id}; the run's vocabulary ({vocab_size} rows) is in the folder", True
    return None, f"the run's {vocab_size} vocabulary rows are neither {hub_id}'s {rows} nor the tokenizer's", False


def write_exports(
    state,
    config,
    tokenizer,
    recipe: dict,
    transposed,
    out_dir: str | None,
    adapter_dir: str | None = None,
    max_shard_size: str = "5GB",
) -> None:
    """Write the model directory `out_dir` (merged for a LoRA run) and, for a LoRA run, the adapter folder
    `adapter_dir`, from a full HF state dict; either may be None."""
    adapter = _adapter_of(recipe)
    if adapter_dir is not None:
        if adapter is None:
            raise ckpt.CheckpointError("no LoRA adapter to export alone (adapter.type is null); export the full model")
        base, why, vocab = adapter_base(recipe, config.vocab_size, tokenizer)
        if base is None:
            where = os.path.join(adapter_dir, BASE_DIR)
            save_hf(
                merge_lora(state, 0.0, transposed), config, where, tokenizer=tokenizer, max_shard_size=max_shard_size
            )
            base = BASE_DIR  # relative: never a path of this machine
            why = f"the frozen base is written to {where} and named {BASE_DIR!r}, relative to the folder: {why}"
        save_adapter(state, config, adapter, transposed, adapter_dir, base, tokenizer=tokenizer, vocab=vocab)
        log.info("LoRA adapter folder %s (AutoPeftModelForCausalLM.from_pretrained); %s", adapter_dir, why)
    if out_dir is not None:
        if adapter is not None:
            state = merge_lora(state, adapter.scaling, transposed)
        save_hf(state, config, out_dir, tokenizer=tokenizer, max_shard_size=max_shard_size)


def export_checkpoint(
    path: str,
    out_dir: str | None,
    max_shard_size: str = "5GB",
    adapter_only: bool = False,
    adapter_dir: str | None = None,
    dtype=None,
    trust_remote_code: bool = False,
) -> str | None:
    """Write the HF model dir for checkpoint `path` (a step dir, or a checkpoint root with `latest`) to
    `out_dir`, and a LoRA run's adapter folder to `adapter_dir`; `adapter_only`: the adapter folder alone, in
    `out_dir`. `dtype` (a torch dtype): the weights' (None: as trained). A full model (no LoRA) is streamed one
    rank file and one tensor at a time, one output file per pipeline rank (`max_shard_size` does not apply).
    `trust_remote_code`: the caller's word (see `checkpoint_model_files`). A checkpoint whose files do not make
    the model (a safetensors header that is not one, tensors of another model, too few vocabulary rows) is a
    CheckpointError naming the file, never a traceback."""
    step_dir = ckpt.resolve(path)
    try:
        return _export(step_dir, out_dir, max_shard_size, adapter_only, adapter_dir, dtype, trust_remote_code)
    except UnreadableSafetensors as e:  # read below the checkpoint code (models/stream_export.py)
        raise ckpt.files.unreadable(e) from None
    except ValueError as e:  # from models/: the tensors' names or rows do not make the model the config describes
        raise ckpt.CheckpointError(
            f"{step_dir} cannot be exported: {' '.join(str(e).split())[:500]}; "
            f"{ckpt.files.fix(os.path.join(step_dir, ckpt.META))}"
        ) from None


def _export(step_dir, out_dir, max_shard_size, adapter_only, adapter_dir, dtype, trust_remote_code):
    if adapter_only is False and adapter_dir is None:  # one model dir: streamed or gathered (models/export.py)
        config, tokenizer, meta = checkpoint_model_files(step_dir, trust_remote_code)
        adapter = _adapter_of(meta.get("recipe"), os.path.join(step_dir, ckpt.META))

        def stream(dtype):  # one rank file and one tensor at a time (models/stream_export.py)
            return export_rank_files(
                replica0_files(step_dir, meta),
                meta["vocab_size"],
                meta.get("sharded_names", ()),
                config,
                out_dir,
                dtype=dtype,
                tokenizer=tokenizer,
                tp=tp_layout(meta),
            )

        def gather():
            state = checkpoint_state(step_dir, trust_remote_code)[0]
            return merge_lora(state, adapter.scaling, meta.get("lora_transposed", [])) if adapter else state

        export_hf(
            config,
            out_dir,
            stream=stream,
            gather=gather,
            merged=adapter is not None,  # tensor-parallel slices: joined by either (stream_export's TPLayout)
            dtype=dtype,
            tokenizer=tokenizer,
            max_shard_size=max_shard_size,
        )
        return out_dir
    state, config, tokenizer, meta = checkpoint_state(step_dir, trust_remote_code)
    _adapter_of(meta.get("recipe"), os.path.join(step_dir, ckpt.META))
    if dtype is not None:
        state = {n: t.to(dtype) if t.is_floating_point() else t for n, t in state.items()}
    if adapter_only:
        out_dir, adapter_dir = None, out_dir
    try:
        write_exports(
            state,
            config,
            tokenizer,
            meta.get("recipe") or {},
            meta.get("lora_transposed", []),
            out_dir,
            adapter_dir,
            max_shard_size,
        )
    except ckpt.CheckpointError as e:
        raise ckpt.CheckpointError(f"{step_dir}: {e}") from None
    return out_dir or adapter_dir
