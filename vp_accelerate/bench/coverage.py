"""Which Hugging Face decoder families the pipeline runs exactly: the walk behind docs/models.md.

For every decoder-only causal LM in the installed transformers that declares a `base_model_pp_plan`
(plus the families with an adapter), `tiny_family_config` builds a small config; `check_families`
saves it with `save_pretrained`, then trains one step with `PipelineModel` on 2 gloo ranks — loaded
from that directory and from the config, with vocab-2 and with the baseline placement — and compares
the loss and every parameter gradient with the HF model in one process (float64, 1e-5 relative).
`export_hf` of the checkpoint-loaded pipeline must write the checkpoint's own tensor names and reload
with `from_pretrained` to the same weights; `eval_step` with dropout 0.1 must equal HF's eval loss.
A family that `families.check_supported` refuses is reported with its reason and never started.

Tiny configs turn on what the family is about at small scale: vocabulary 101 (not divisible by 2),
hidden 64, 4 layers, 4 heads / 2 KV heads, 4 experts with 2 active for mixture-of-experts families.
Dropout is set to 0: with it on, training is random and no exact comparison exists (PipelineModel
applies the model's dropout in `train_step`, as HF does in train mode, and none in `eval_step`).
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.utils import logging as hf_logging

from vp_accelerate.distributed import spawn
from vp_accelerate.models.adapter import UnsupportedModelError
from vp_accelerate.models.build import build_rank, resolve_config
from vp_accelerate.models.families import REFUSED, check_supported, decoder_families
from vp_accelerate.models.layout import StageLayout
from vp_accelerate.runtime import PipelineConfig, PipelineModel
from vp_accelerate.safetensors_file import open_safetensors
from vp_accelerate.vocab.partition import VocabPartition

#: Rotary parameters per layer type of the families whose sliding layers have their own frequencies.
SLIDING_ROPE = {
    "sliding_attention": dict(rope_type="default", rope_theta=1e4),
    "full_attention": dict(rope_type="default", rope_theta=5e5),
}

#: Shape every tiny config gets, where the family's config has the field.
TINY = dict(
    vocab_size=101,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # mixture of experts: 4 experts, 2 per token, small expert MLPs, one shared expert
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    # multi-head latent attention (DeepSeek-V2/V3 style)
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)

#: Per-family corrections of TINY (fields the family names differently, or shapes it constrains).
OVERRIDES: dict[str, dict] = {
    "gpt2": dict(n_positions=128),
    "codegen": dict(rotary_dim=8, n_ctx=128),
    "gptj": dict(rotary_dim=8),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=5, final_logit_softcapping=0.5, attn_logit_softcapping=2.0),
    "gemma3_text": dict(head_dim=16, sliding_window=5, sliding_window_pattern=2),
    # sliding layers with their own rotary frequencies (the rotary embedding takes the layer type)
    "olmo3": dict(
        sliding_window=5,
        rope_parameters=SLIDING_ROPE,
    ),
    "beam": dict(
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=SLIDING_ROPE,
    ),
    "cohere_compass_text": dict(
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=SLIDING_ROPE,
    ),
    "mistral": dict(sliding_window=5),
    "granite": dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5, attention_multiplier=0.3),
    "cohere": dict(logit_scale=0.5),
    "phi": dict(partial_rotary_factor=0.5),
    # sparse "indexed" layers every other layer, as the released config has them every fifth (4 layers here)
    "kolibri1_1": dict(
        head_dim=16,
        sliding_window=5,
        layer_types=["sliding_attention", "indexed_attention"] * 2,
        index_layers=[1, 3],
        index_num_heads=2,
        index_topk=4,
        index_pool_size=16,
        index_compression=4,
        index_num_local_tokens=2,
        index_num_sink_tokens=1,
    ),
}

#: Config fields that are dropout probabilities (zeroed: an exact comparison needs dropout off).
DROPOUT_FIELDS = (
    "attention_dropout",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
    "hidden_dropout",
    "residual_dropout",
    "embedding_dropout",
    "summary_first_dropout",
    "classifier_dropout",
    "mlp_dropout",
    "dropout",
    "ffn_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)

SEQ = (4, 10)  # (batch, sequence) of the compared step; 2 microbatches of 2 rows
METHODS = ("vocab-2", "baseline")
SOURCES = ("checkpoint", "config")
RTOL = 1e-5
DROPOUT_SUFFIX = "-dropout"  # the same checkpoint with dropout 0.1, for the evaluation check
EXPORT_SUFFIX = "-export"  # export_hf of the checkpoint-loaded vocab-2 pipeline


def dropout_fields(config) -> list[str]:
    """The dropout probabilities `config` has (of DROPOUT_FIELDS)."""
    return [k for k in DROPOUT_FIELDS if isinstance(getattr(config, k, None), float)]


def tiny_family_config(model_type: str, **overrides):
    """A small config of `model_type`: TINY fields the family has, its OVERRIDES, dropout off."""
    default = CONFIG_MAPPING[model_type]()
    if model_type in REFUSED or getattr(default, "is_heterogeneous", False):
        return default  # refused by its type: no tiny shape needed (per-layer configs reject global fields)
    kw = {k: v for k, v in TINY.items() if _has_field(default, k)}
    if _has_field(default, "qk_rope_head_dim"):  # latent attention: every head has its own keys and values
        kw["num_key_value_heads"] = TINY["num_attention_heads"]
    elif _has_field(default, "head_dim"):
        kw["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
    kw.update(copy.deepcopy(OVERRIDES.get(model_type, {})))  # a config may change the dicts it is given
    kw.update({k: 0.0 for k in dropout_fields(default)})
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def _quiet() -> None:
    """No progress bars or per-family warnings (a walk over 90 families would print thousands of lines)."""
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("vp_accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _has_field(config, key: str) -> bool:
    return hasattr(config, key) or key in getattr(config, "attribute_map", {})


@dataclass
class FamilyResult:
    """One family's outcome in the walk."""

    model_type: str
    """config.model_type."""
    status: str
    """"pass", "refused" (by check_supported, before any process starts), "fail" (numbers differ) or "crash"."""
    reason: str = ""
    """Why it was refused / what differed / the error; empty on pass."""
    worst: dict[str, float] = field(default_factory=dict)
    """(source/method) -> worst relative error over the loss and every gradient."""


def _batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, SEQ, generator=g)  # not pad/bos/eos ids (HF gives the padding row no gradient)
    labels = ids.clone()
    labels[0, 6:] = -100  # ignored tokens inside the batch
    labels[3, 2] = -100
    return ids, labels


@torch.no_grad()
def _screen(ckpt: str) -> None:
    """Build both ranks of both placements from the checkpoint and run one forward in this process: a family
    that crashes fails here, alone, instead of stopping the 2-rank run of every family with it."""
    cfg = resolve_config(ckpt)
    layout = StageLayout.one_per_rank(cfg.num_hidden_layers, 2)
    for r in range(2):
        build_rank(
            ckpt,
            layout,
            r,
            "vocab",
            VocabPartition(cfg.vocab_size, 2),
            dtype=torch.float64,
            attn_implementation="eager",
        )
    rms = [build_rank(ckpt, layout, r, "baseline", dtype=torch.float64, attn_implementation="eager") for r in range(2)]
    ids, _ = _batch(cfg.vocab_size, 0)
    h = rms[0].embed_tokens(ids)
    for c, owner in enumerate(layout.chunk_rank):
        h = rms[owner].chunks[c](h)
    rms[1].head_logits(h)


def _rank_worker(cases: list[tuple[str, str, int]]):
    """On each rank: one train step per (family, source, method); HF-named gradients and the weights."""
    _quiet()
    out = {}
    for model_type, ckpt, seed in cases:
        cfg = tiny_family_config(model_type)
        ids, labels = _batch(cfg.vocab_size, seed)
        for source_kind in SOURCES:
            for method in METHODS:
                source = ckpt if source_kind == "checkpoint" else copy.deepcopy(cfg)
                pipe = PipelineModel(
                    source,
                    PipelineConfig(
                        schedule="1f1b",
                        method=method,
                        microbatches=2,
                        attn_implementation="eager",
                        watchdog_dead_after_s=None,
                    ),
                    dtype=torch.float64,
                    seed=seed,
                )
                res = pipe.train_step(ids, labels)
                if source_kind == "checkpoint" and method == "vocab-2":  # no optimizer step: the same weights
                    pipe.export_hf(ckpt + EXPORT_SUFFIX)
                grads = {
                    n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().numpy().copy()
                    for n, p in pipe.named_parameters()
                    if p.requires_grad and not pipe.mods.is_duplicate(n)
                }
                weights = pipe.gather_hf_state_dict() if source_kind == "config" else None
                if weights is not None:
                    weights = {n: t.numpy().copy() for n, t in weights.items()}
                out[(model_type, source_kind, method)] = (res.loss, grads, sorted(pipe.mods.sharded_names), weights)
                pipe.close()
                dist.barrier()
        if Path(ckpt + DROPOUT_SUFFIX).is_dir():  # eval_step runs without the model's dropout
            pipe = PipelineModel(
                ckpt + DROPOUT_SUFFIX,
                PipelineConfig(microbatches=2, attn_implementation="eager", watchdog_dead_after_s=None),
                dtype=torch.float64,
            )
            out[(model_type, "eval")] = pipe.eval_step(ids, labels)
            pipe.close()
    return out


def _reference(model_type: str, ckpt: str, weights, ids, labels):
    """HF loss and gradients in one process, float64, eager kernels."""
    kw = dict(dtype=torch.float64, attn_implementation="eager")
    if weights is None:
        model = AutoModelForCausalLM.from_pretrained(ckpt, **kw)
    else:
        model = AutoModelForCausalLM.from_config(tiny_family_config(model_type), **kw)
        sd = {n: torch.from_numpy(w) for n, w in weights.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        params = dict(model.named_parameters(remove_duplicate=False))
        tied = {n for n in missing if params.get(n) is model.get_output_embeddings().weight}
        if set(missing) - tied or unexpected:
            raise AssertionError(
                f"gathered weights do not match the HF model: missing {missing}, unexpected {unexpected}"
            )
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")  # grouped matmul has no float64 kernel
    model.train()  # dropout is 0 in tiny configs: train mode only matters to families that branch on it
    logits = model(input_ids=ids, use_cache=False).logits
    # HF's own loss casts the logits to float32; the same token-mean cross-entropy in float64 keeps the
    # comparison at float64 rounding
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    loss.backward()
    # parameters with requires_grad=False (e.g. a router's load-balancing bias updated outside autograd) are not trained
    return loss.item(), {
        n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad
    }


def _checkpoint_keys(path: str) -> set[str]:
    index = Path(path) / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with open_safetensors(Path(path) / "model.safetensors") as f:
        return set(f.keys())


@torch.no_grad()
def _compare_export(ckpt: str, exported: str) -> str:
    """ "" when export_hf wrote the checkpoint's own tensor names and from_pretrained loads the same weights."""
    want_keys, got_keys = _checkpoint_keys(ckpt), _checkpoint_keys(exported)
    if want_keys != got_keys:
        return f"tensor names differ from save_pretrained's: {sorted(want_keys ^ got_keys)[:4]}"
    want = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    got = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    bad = [k for k in want if k not in got or not torch.equal(want[k], got[k])]
    return f"reloaded weights differ: {bad[:4]}" if bad else ""


@torch.no_grad()
def _compare_eval(ckpt: str, got: float, ids, labels) -> float:
    """Relative error of eval_step's loss against HF's model.eval() (from_pretrained's mode) on a dropout model."""
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    assert not model.training
    logits = model(input_ids=ids, use_cache=False).logits
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    ).item()
    return abs(got - want) / abs(want)


def _compare(model_type, key, per_rank, ckpt, ids, labels) -> tuple[float, str]:
    """Worst relative error of one (source, method) run and a description of it."""
    results = [r[key] for r in per_rank]
    weights = results[0][3]
    want_loss, want = _reference(model_type, ckpt, weights, ids, labels)
    worst, what = abs(results[0][0] - want_loss) / abs(want_loss), "loss"
    if any(r[0] != results[0][0] for r in results):
        return float("inf"), f"ranks disagree on the loss: {[r[0] for r in results]}"
    sharded = set(results[0][2])
    got: dict[str, torch.Tensor] = {}
    parts: dict[str, list] = {}
    for r in results:
        for name, g in r[1].items():
            if name in sharded:
                parts.setdefault(name, []).append(torch.from_numpy(g))
            elif name in got:
                return float("inf"), f"{name} held by two ranks"
            else:
                got[name] = torch.from_numpy(g)
    for name, shards in parts.items():
        full, V = torch.cat(shards), want[name].shape[0]
        if full.shape[0] > V and full[V:].abs().max() > 0:
            return float("inf"), f"{name}: padded rows got a gradient"
        got[name] = full[:V]
    # a parameter one side does not train (requires_grad=False, e.g. a router's load-balancing bias, which
    # from_pretrained turns back on) must then get no gradient on the other side either
    for name in set(want) - set(got):
        if want[name].abs().max() > 0:
            return float("inf"), f"{name} has an HF gradient but is not trained by the pipeline"
        got[name] = torch.zeros_like(want[name])
    for name in set(got) - set(want):
        if got[name].abs().max() > 0:
            return float("inf"), f"{name} gets a gradient in the pipeline but not in HF"
        want[name] = torch.zeros_like(got[name])
    for name, w in want.items():
        scale = w.abs().max().item()
        err = (got[name] - w).abs().max().item()
        rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
        if rel > worst:
            worst, what = rel, name
    return worst, what


def check_families(
    model_types: list[str], workdir: str | Path | None = None, timeout_s: float = 1200.0, seed: int = 0
) -> list[FamilyResult]:
    """Refuse or run every family in `model_types` (one 2-rank spawn for all that are accepted)."""
    _quiet()
    results: dict[str, FamilyResult] = {}
    cases = []
    tmp = tempfile.TemporaryDirectory() if workdir is None else None
    root = Path(workdir if workdir is not None else tmp.name)
    for i, mt in enumerate(model_types):
        try:
            cfg = tiny_family_config(mt)
            check_supported(cfg)
        except UnsupportedModelError as e:
            results[mt] = FamilyResult(mt, "refused", str(e))
            continue
        except Exception as e:  # a config we cannot even build is a crash of the walk, not a refusal
            results[mt] = FamilyResult(mt, "crash", f"{type(e).__name__}: {e}")
            continue
        torch.manual_seed(seed + i)
        ckpt = root / mt
        model = AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(ckpt)
        if dropout_fields(cfg):
            for k in dropout_fields(cfg):
                setattr(model.config, k, 0.1)
            model.save_pretrained(str(ckpt) + DROPOUT_SUFFIX)
        try:
            _screen(str(ckpt))
        except Exception as e:
            results[mt] = FamilyResult(mt, "crash", f"{type(e).__name__}: {e}")
            continue
        cases.append((mt, str(ckpt), seed + i))
    if cases:
        per_rank = spawn(_rank_worker, 2, cases, timeout_s=timeout_s)
        for mt, ckpt, s in cases:
            ids, labels = _batch(tiny_family_config(mt).vocab_size, s)
            res = FamilyResult(mt, "pass")
            for source_kind in SOURCES:
                for method in METHODS:
                    try:
                        worst, what = _compare(mt, (mt, source_kind, method), per_rank, ckpt, ids, labels)
                    except Exception as e:
                        where = traceback.extract_tb(e.__traceback__)[-1]
                        res.status = "crash"
                        res.reason = (
                            f"{type(e).__name__}: {e} (comparing {source_kind}/{method}, {where.name}:{where.lineno})"
                        )
                        break
                    res.worst[f"{source_kind}/{method}"] = worst
                    if not worst <= RTOL and res.status == "pass":
                        res.status = "fail"
                        res.reason = f"{source_kind}/{method}: {what} differs by {worst:.1e} (relative)"
            if res.status == "pass":
                problem = _compare_export(ckpt, ckpt + EXPORT_SUFFIX)
                if problem:
                    res.status, res.reason = "fail", f"export_hf: {problem}"
            if res.status == "pass" and (mt, "eval") in per_rank[0]:
                err = _compare_eval(ckpt + DROPOUT_SUFFIX, per_rank[0][(mt, "eval")], ids, labels)
                res.worst["eval"] = err
                if not err <= RTOL:
                    res.status, res.reason = "fail", f"eval_step with dropout 0.1 differs from HF eval by {err:.1e}"
            results[mt] = res
    if tmp is not None:
        tmp.cleanup()
    return [results[mt] for mt in model_types]


HEADER = """# Model families

Every decoder-only causal LM of the installed transformers that declares a `base_model_pp_plan` (and
GPT-2, which has an adapter), as `scripts/model_coverage.py` last found it (transformers {version}, the
version the `dev` extra pins). **pass**: a tiny config
saved with `save_pretrained`, loaded by `PipelineModel` from that directory and from the config, trained
one step on 2 gloo ranks with vocab-2 and with the baseline placement: the loss and every parameter
gradient equal the Hugging Face model's in one process (float64, within 1e-5 relative; the column is
the worst relative error over the loss and all gradients of the four runs); `export_hf` writes the
checkpoint's own tensor names and `from_pretrained` reloads the same weights; `eval_step` equals HF's
`model.eval()` loss with dropout 0.1 (families with dropout fields). **refused**: the pipeline
raises `UnsupportedModelError` with this reason before any process group starts (preflight and
`PipelineModel` call `vp_accelerate.models.check_supported`).

Notes:
- Dropout is off in the compared configs: `train_step` applies the model's dropout like HF in train
  mode (so it is random), `eval_step` runs without it like `model.eval()`.
- Mixture-of-experts families run with `output_router_logits: false` (their released default): HF's
  load-balancing loss is one product of means over all layers and all tokens of a batch, which does not
  split over pipeline stages and microbatches; a config that turns it on is refused.
- An output-layer bias (Phi) is sharded with the vocabulary rows: each rank adds its entries to its
  logits and accumulates their gradient (column sums of the logit gradient); padded rows stay out of
  the softmax.

"""


def write_table(results: list[FamilyResult], path: str | Path) -> None:
    """docs/models.md: the header above and one row per family (family, status, worst error / reason)."""
    lines = [
        HEADER.replace("{version}", transformers.__version__),
        "| family | status | worst rel. error / reason |",
        "|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r.status != "pass", r.model_type)):
        detail = f"{max(r.worst.values()):.1e}" if r.status == "pass" else r.reason.replace("|", "/")
        lines.append(f"| {r.model_type} | {r.status} | {' '.join(detail.split())} |")
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "refused", "fail", "crash")}
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f" of {len(results)} families.")
    Path(path).write_text("\n".join(lines) + "\n")


__all__ = ["FamilyResult", "check_families", "decoder_families", "tiny_family_config", "write_table"]
