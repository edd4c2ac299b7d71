"""Check a recipe against its model, tokenizer and world size before any process group starts.

`recipe.check` validates a recipe on its own; this goes one step further, reading the model's config and
the tokenizer (offline, cheaply) and asking the schedule and layout builders whether the run can exist:
pipeline ranks vs layers, microbatches vs ranks, interleaving vs layers, vocabulary vs ranks, sequence
length vs positions, tokenizer vs model vocabulary, custom model code vs `trust_remote_code`. Every rank
under `accelerate launch` runs it first, so a run that cannot work fails everywhere at once, in seconds,
with exit code 2 and the key to change. Sources that cannot be read offline (hub ids) are skipped.
"""

from __future__ import annotations

import json
import os

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from vp_accelerate.cost import plan_layout
from vp_accelerate.model_config import ModelConfigError, read_config_json
from vp_accelerate.models import unsupported_reason
from vp_accelerate.models.layout import LayoutError
from vp_accelerate.models.tensor_parallel import TPError
from vp_accelerate.models.tensor_parallel import check_config as check_tp_config
from vp_accelerate.runtime import tensor_parallel
from vp_accelerate.safetensors_file import UnreadableSafetensors, check_header
from vp_accelerate.schedule import ScheduleError, build_schedule
from vp_accelerate.schedule.registry import METHODS

from ..data.check import check_columns
from ..data.formats import chat_template_of, document_boundaries, sample_format
from ..data.read import DataError, first_record_columns
from ..data.sources import builder_for, expand_files
from ..persist import resume_check
from ..persist import store as ckpt
from ..persist.hub_push import check_push
from ..recipe.checks import describe_batch
from ..recipe.convert import RecipeError
from ..recipe.load import recipe_to_dict
from ..recipe.model_check import check_adapter_targets, model_dir
from ..recipe.presets import MODEL_FIX, PRESETS, recipe_model_config, uses_pretrained_weights
from ..tokens.vocab_plan import (
    model_tokenizer_of,
    open_tokenizer,
    plan_vocab,
    prepare_tokenizers,
    tokenizer_source,
    trainable_token_rows,
)


def world_size_from_env() -> int | None:
    """The launched world size (accelerate launch / torchrun set WORLD_SIZE in every process)."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def _local_dir(source: str) -> str | None:
    path = os.path.expanduser(source)
    return path if os.path.isdir(path) else None


def _json_file(path: str, key: str) -> dict:
    """A model or tokenizer JSON file as a dict; RecipeError naming the file (and line) when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise RecipeError(f"{key}: {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{key}: {path} is not UTF-8 text") from None
    except RecursionError:  # json's parser recurses per level
        raise RecipeError(f"{key}: {path} is not valid JSON (nested deeper than the parser's limit)") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{key}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def _config_json(path: str) -> dict:
    """A local model's config.json, read within limits and its sizes checked (model_config.py)."""
    try:
        return read_config_json(path, MODEL_FIX)
    except ModelConfigError as e:
        raise RecipeError(f"model.source: {e}") from None


def check_weight_files(src: str) -> None:
    """The safetensors files of a local model are there and readable: every shard its index names (names inside
    the model folder only: never `../` or an absolute path), each with a valid safetensors header (its length,
    JSON and offsets within the file). Else the first rank to read one fails with a traceback."""
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _json_file(index, "model.source").get("weight_map") or {}
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise RecipeError(f"model.source: {index}: weight_map is not an object of tensor name -> file name")
        shards = sorted(set(weight_map.values()))
        for name in shards:
            parts = name.replace("\\", "/").split("/")
            if not name or os.path.isabs(name) or ".." in parts or len(parts) > 1:
                raise RecipeError(
                    f"model.source: {index} names the weight file {name[:80]!r}, which is not a file in {src}; "
                    f"copy the model again"
                )
        missing = [name for name in shards if not os.path.isfile(os.path.join(src, name))]
        if missing:
            raise RecipeError(
                f"model.source: {src} is missing {len(missing)} of the {len(shards)} weight files its "
                f"model.safetensors.index.json names ({', '.join(missing[:3])}); copy the model again"
            )
    elif os.path.isfile(os.path.join(src, "model.safetensors")):
        shards = ["model.safetensors"]
    else:
        return
    for name in shards:
        path = os.path.join(src, name)
        try:
            check_header(path)  # reads the header only
        except UnreadableSafetensors as e:
            why = e.why.removeprefix("cannot be read (").removesuffix(")")
            raise RecipeError(
                f"model.source: {path} is not a readable safetensors file ({why}); copy the model again"
            ) from None


def _check_remote_code(recipe) -> None:
    """Custom modelling/tokenizer code (`auto_map`) runs only where the recipe says so."""
    if recipe.model.trust_remote_code:
        return
    src = _local_dir(recipe.model.source)
    if src and os.path.isfile(os.path.join(src, "config.json")):
        cfg = _config_json(os.path.join(src, "config.json"))
        if "auto_map" in cfg and cfg.get("model_type") not in CONFIG_MAPPING:
            raise RecipeError(
                f"model.trust_remote_code: {src} needs its own modelling code (model_type "
                f"{cfg.get('model_type')!r}, auto_map {sorted(cfg['auto_map'])}), which is not run "
                f"unless the recipe sets model.trust_remote_code: true — only for a source you trust"
            )
    tok = tokenizer_source(recipe)
    tdir = _local_dir(tok[4:] if tok.startswith("bpe:") else tok)
    if tdir and os.path.isfile(os.path.join(tdir, "tokenizer_config.json")):
        tcfg = _json_file(os.path.join(tdir, "tokenizer_config.json"), "tokenizer.source")
        if "auto_map" in tcfg and not os.path.isfile(os.path.join(tdir, "tokenizer.json")):
            raise RecipeError(
                f"model.trust_remote_code: the tokenizer in {tdir} needs its own code (auto_map "
                f"{tcfg['auto_map']}) and has no tokenizer.json; set model.trust_remote_code: true "
                f"only for a source you trust"
            )


def _model_config(recipe, full: bool = True):
    """The model config the run will use, or None when it cannot be read before launch (a hub id not yet in the
    local cache, on a launched rank: full=False; `--check` reads its config from the hub)."""
    m = recipe.model
    pretrained = uses_pretrained_weights(m)
    if m.source in PRESETS:
        try:
            return recipe_model_config(m.source, m.config, pretrained=pretrained)
        except RecipeError:
            raise
        except (TypeError, ValueError) as e:
            raise RecipeError(f"model.config: {e}") from None
    src = model_dir(m.source, download=False)
    if src is None and not full:
        return None  # rank 0 downloads it at the start; a launched rank does not ask the hub
    src = src or m.source  # --check: a hub id's config read from the hub
    if os.path.isfile(os.path.join(src, "config.json")):
        _config_json(os.path.join(src, "config.json"))
        if pretrained:
            check_weight_files(src)
    try:  # as the trainer reads it (`plan_model`)
        return recipe_model_config(src, m.config, m.trust_remote_code, pretrained)
    except RecipeError:
        raise
    except (OSError, ValueError) as e:
        raise RecipeError(f"model.source: cannot read the config of {src}: {str(e).splitlines()[0]}") from None


def _local_tokenizer(recipe):
    """The run's tokenizer when it is on disk (bpe:<dir>, a local dir, a converted Qwen); None otherwise."""
    return open_tokenizer(recipe, tokenizer_source(recipe), fetch=False)


def vocab_decision(recipe, config, full: bool = True, found: dict | None = None):
    """The run's `VocabPlan`, or None when a tokenizer cannot be read offline (`found["tokenizer"]`: the tokenizer
    as the run will use it, for the data check).

    full=False (every rank under a launcher) skips what is slow and cannot fail: converting a Qwen tokenizer
    and building a swap's row map (the trainer builds it); the row counts are still decided.
    """
    source = tokenizer_source(recipe)
    tokenizer = open_tokenizer(recipe, source, fetch=full)
    if tokenizer is None:
        return None
    pretrained = uses_pretrained_weights(recipe.model)
    model_tokenizer = model_tokenizer_of(recipe, tokenizer, source, lambda own: open_tokenizer(recipe, own, fetch=full))
    chat = prepare_tokenizers(recipe, tokenizer, model_tokenizer, pretrained)  # the tokens it adds need rows
    if found is not None:
        found["tokenizer"] = tokenizer
    return plan_vocab(recipe, config.vocab_size, tokenizer, pretrained, model_tokenizer, build_map=full, chat=chat)


def _data_note(recipe) -> str:
    """Which sample format the data has (declared or detected from the first file's columns), and for chat
    which template renders it."""
    d = recipe.data
    if d.hub_id:
        return "data: a hub dataset; its format is detected from its columns at the start of the run"
    try:
        paths = [p for p in expand_files(d.files) if os.path.getsize(p) > 0][:1]
        columns = first_record_columns(paths[0], builder_for(paths, d)) if paths else None
        if columns is None:
            raise DataError(f"data.files: no record in {expand_files(d.files)[:3]}")
        fmt, how = sample_format(d, columns, where=paths[0])
    except DataError as e:
        raise RecipeError(str(e) if str(e).startswith("data") else f"data: {e}") from None
    note = f"data format {fmt} ({how})"
    if fmt == "chat":
        tok = _local_tokenizer(recipe)
        if tok is None:
            note += "; chat template: decided when the tokenizer is loaded (the tokenizer's own, else ChatML)"
        else:
            note += (
                "; chat template: ChatML default (the tokenizer has none)"
                if chat_template_of(tok)[1]
                else "; chat template: the tokenizer's own"
            )
    if fmt != "text":
        note += (
            "; loss on every token (data.train_on_inputs)"
            if d.train_on_inputs
            else "; loss on " + ("assistant turns" if fmt == "chat" else "completions") + " only"
        )
    if fmt in ("preference", "unpaired_preference"):  # whole rows, one a sequence: data.packing does not apply
        unit = "pairs" if fmt == "preference" else "rows"
        note += f"; {unit} never packed (each row its own padded sequence)"
    elif d.packing:
        note += "; packed " + (
            "keeping document boundaries" if document_boundaries(d, fmt) else "across documents (EOS-separated)"
        )
    return note


def _check_data(recipe) -> list[str]:
    """Text-format local files must hold `data.text_field` (checked on the first record of every file)."""
    d = recipe.data
    if d.hub_id or d.format in ("chat", "prompt_completion"):
        return []  # a hub dataset's columns are known at the start of the run; SFT formats check their fields
    try:
        check_columns(d)
    except DataError as e:
        raise RecipeError(str(e) if str(e).startswith("data.") else f"data.files: {e}") from None
    return []


def check_run_dirs(recipe, resume: str | None = None, override: tuple = ()) -> list[str]:
    """Check where checkpoints go (`checkpoint.dir`, default `<output_dir>/checkpoints`) and that this run may
    write there: a new run never mixes its checkpoints with an earlier run's (that needs `--resume`), and
    `--resume` must name a complete checkpoint saved with this run's optimizer, schedule and data (or
    `--override` says to apply this run's: `persist/resume_check.py`). Returns notes for `--check`."""
    out = recipe.logging.output_dir
    for key, folder in (("logging.output_dir", out), ("checkpoint.dir", recipe.checkpoint.dir)):
        if folder and os.path.exists(folder) and not os.path.isdir(folder):
            raise RecipeError(f"{key}: {folder} is a file, not a directory; point {key} at a directory (or a new path)")
    if recipe.model.init_from is not None:  # a checkpoint of another run: it must be there and complete
        try:
            ckpt.read_meta(ckpt.resolve(os.path.expanduser(recipe.model.init_from)))  # its format version too
        except ckpt.CheckpointError as e:
            raise RecipeError(f"model.init_from: {e}") from None
    c, out = recipe.checkpoint, recipe.logging.output_dir
    explicit = c.dir is not None and c.dir != os.path.join(out, "checkpoints")  # else it follows logging.output_dir
    cdir = c.resolved_dir(out)  # the recipe is left as it is: the trainer's resolved recipe carries this dir
    if cdir is None:
        push = check_push(c)
        if resume is not None:
            raise RecipeError("checkpoint.enabled: --resume needs checkpoints; set checkpoint.enabled: true")
        export = (
            f"the final model is still exported to {os.path.join(out, 'hf')}"
            if c.export_hf
            else "no final export (checkpoint.export_hf: false)"
        )
        return [f"checkpoints off (checkpoint.enabled: false): no resume; {export}"] + ([push] if push else [])
    try:
        found = ckpt.resume_path(cdir, resume or "latest")
    except ckpt.CheckpointError as e:
        raise RecipeError(f"checkpoint.dir: {' '.join(str(e).split())}") from None
    if resume is None:
        latest = found
        if latest is not None:
            other = (
                "another checkpoint.dir (it is set in the recipe)"
                if explicit
                else "another logging.output_dir (--set logging.output_dir=DIR; checkpoints go to DIR/checkpoints)"
            )
            raise RecipeError(
                f"checkpoint.dir: {cdir} holds checkpoints of an earlier run (latest "
                f"{os.path.basename(latest)}); continue that run with --resume, or start a new one in "
                f"{other}"
            )
    elif found is not None:
        _check_resume(recipe, found, override)
    push = check_push(c)
    every = f"every {c.every} steps and " if c.every else ""
    export = f"; the final model is exported to {os.path.join(out, 'hf')}" if c.export_hf else ""
    return [f"checkpoints in {cdir}, {every}at the end, keeping the last {c.keep}{export}"] + ([push] if push else [])


def _check_resume(recipe, path: str, override: tuple) -> None:
    """The checkpoint `--resume` names was saved with this run's optimizer, schedule and data (else RecipeError
    listing each difference, unless `--override` names it). Its meta.json must be readable."""
    try:
        meta = ckpt.read_meta(path)
    except ckpt.CheckpointError as e:
        raise RecipeError(str(e)) from None
    try:
        data = resume_check.data_identity(recipe.data) if meta.get("data") is not None else None
    except (DataError, FileNotFoundError):
        data = None  # the data check names the file
    resume_check.check(path, meta, recipe_to_dict(recipe), data, override)


def pipeline_size(recipe, world_size: int | None) -> int | None:
    """Pipeline ranks of the run: pipeline.pp_size, or world size / dp_size; None when unknown."""
    p = recipe.pipeline
    tp = p.tp_size
    if world_size is not None:
        if p.pp_size is not None and p.pp_size * p.dp_size * tp != world_size:
            sizes = f"pp_size={p.pp_size}{f' x tp_size={tp}' if tp > 1 else ''} x dp_size={p.dp_size}"
            raise RecipeError(
                f"pipeline.pp_size: {sizes} = {p.pp_size * tp * p.dp_size}, but {world_size} processes are "
                f"launched; {_layouts(world_size, tp)}"
            )
        if world_size % (p.dp_size * tp):
            key = "pipeline.tp_size" if world_size % tp else "pipeline.dp_size"
            stages = f" of stages of {tp} tensor-parallel ranks" if tp > 1 else ""
            raise RecipeError(
                f"{key}: {world_size} processes cannot form {p.dp_size} equal replicas{stages}; "
                f"{_layouts(world_size, tp)}"
            )
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if tp > 1 and local and local.isdigit() and int(local) % tp:
            raise RecipeError(
                f"pipeline.tp_size: {tp} tensor-parallel ranks do not fit the {local} processes of a node "
                f"(TP collectives run in every layer: keep a stage's TP ranks in one node); use a tp_size that "
                f"divides {local}"
            )
        return world_size // (p.dp_size * tp)
    return p.pp_size


def _layouts(world_size: int, tp: int = 1) -> str:
    """The (pp_size, dp_size) pairs `world_size` processes can hold (with `tp` TP ranks a stage), for an error
    message."""
    if world_size % tp:
        return f"tp_size must divide the {world_size} processes"
    n = world_size // tp
    pairs = [f"pp_size={n // dp} dp_size={dp}" for dp in range(1, n + 1) if n % dp == 0]
    at = f" at tp_size={tp}" if tp > 1 else ""
    return f"{world_size} processes hold{at} " + ", ".join(pairs)


def _check_tensor_parallel(recipe, config) -> None:
    """pipeline.tp_size against the model (plan, heads, MLP width), the method and the adapter, and the sequence
    under sequence parallelism: one line before anything loads."""
    p = recipe.pipeline
    try:
        check_tp_config(config, p.tp_size)
        tensor_parallel.check_layout(p, recipe.adapter)
    except TPError as e:
        raise RecipeError(str(e)) from None
    if tensor_parallel.sequence_parallel(p) and recipe.data.seq_len % p.tp_size:
        raise RecipeError(
            f"data.seq_len: {recipe.data.seq_len} tokens do not split over tp_size={p.tp_size} ranks under sequence "
            f"parallelism; use a seq_len divisible by {p.tp_size}, or pipeline.sequence_parallel: false"
        )


def _check_schedule(recipe, config, pp: int) -> str:
    """Build the schedule and layout as the runtime will; their errors become recipe errors."""
    p = recipe.pipeline
    try:
        schedule = build_schedule(p.schedule, p.method, pp, p.microbatches, chunks_per_rank=p.chunks_per_rank)
    except ScheduleError as e:
        key = (
            "pipeline.microbatches"
            if "num_microbatches" in str(e)
            else "pipeline.chunks_per_rank"
            if "chunks_per_rank" in str(e)
            else "pipeline.schedule"
        )
        if key == "pipeline.microbatches" and recipe.train.gradient_accumulation_steps is not None:
            key = "train.gradient_accumulation_steps"  # it set pipeline.microbatches
        raise RecipeError(f"{key}: {e} (pipeline of {pp} ranks)") from None
    chunks = len(schedule.chunk_rank)
    layers = config.num_hidden_layers
    try:
        layout = plan_layout(config, schedule, p.layers_per_stage)  # as PipelineModel will
    except LayoutError as e:
        key = "pipeline.layers_per_stage" if p.layers_per_stage is not None else "pipeline"
        raise RecipeError(
            f"{key}: {e} [{p.schedule} on {pp} ranks: {chunks} chunks; model: {layers} decoder layers]"
        ) from None
    counts = [end - start for start, end in layout.chunk_layers]
    return f"{p.schedule} x {p.method} on {pp} ranks, {p.microbatches} microbatches, layers per chunk {counts}"


def check_plan(recipe, world_size: int | None = None, full: bool = True, found: dict | None = None) -> list[str]:
    """Raise RecipeError if the run described by `recipe` on `world_size` processes cannot work.

    Returns notes on what was checked (and what could not be, e.g. a hub model offline), the vocabulary
    decision among them. full=False: the quick form every launched rank runs (see `vocab_decision`).
    `found` (a dict, filled when given): the model `config`, the vocabulary `plan` and the `tokenizer`, for the
    data check of `--check`.
    """
    found = {} if found is None else found
    _check_remote_code(recipe)
    notes = [_data_note(recipe)] + _check_data(recipe)
    pp = pipeline_size(recipe, world_size)  # a layout the world size cannot hold fails before anything loads
    config = found["config"] = _model_config(recipe, full)
    if config is None:
        return notes + [f"model {recipe.model.source!r} is not local: its shape was not checked before launch"]
    if (why := unsupported_reason(config)) is not None:  # a family the pipeline cannot run exactly
        raise RecipeError(f"model.source: {why}")
    _check_tensor_parallel(recipe, config)
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos and recipe.data.seq_len > max_pos:
        raise RecipeError(
            f"data.seq_len: {recipe.data.seq_len} tokens exceed the model's max_position_embeddings="
            f"{max_pos}; lower data.seq_len to at most {max_pos}"
        )
    if (lora := check_adapter_targets(recipe, config)) is not None:
        notes.append(lora)
    plan = found["plan"] = vocab_decision(recipe, config, full=full, found=found)
    vocab = config.vocab_size
    if plan is None:
        notes.append("tokenizer not on disk yet: its size was not compared with the model's")
    else:
        vocab = plan.rows_after
        notes += plan.lines()
        _, rows_note = trainable_token_rows(recipe, found["tokenizer"], plan.chat, vocab)
        notes += [rows_note] if rows_note else []
    if pp is None:
        notes.append(describe_batch(recipe))
        notes.append("world size unknown (not launched; pass --world-size to --check): schedule not checked")
        return notes
    if METHODS[recipe.pipeline.method].vocab_parallel and vocab < pp:
        raise RecipeError(
            f"tokenizer: a vocabulary of {vocab} tokens cannot be sharded over {pp} pipeline ranks "
            f"(every rank needs at least one row); use a larger vocabulary or fewer ranks"
        )
    notes.append(_check_schedule(recipe, config, pp))
    notes.append(describe_batch(recipe, pp))
    notes.append(f"vocabulary {vocab} rows, seq_len {recipe.data.seq_len} <= max positions {max_pos}")
    return notes
