"""LoRA adapters (through `peft`) on one rank's stage chunks, and the two ways to export them.

`apply_lora` injects peft's LoRA layers into every stage chunk of the rank (`peft.inject_adapter_in_model`:
the same `lora.Linear` modules `get_peft_model` puts in a whole model), freezes everything else, and
initialises each adapter from (seed, its HF module name) — so the initial adapters do not depend on how
the model was cut, and a single-process peft model gets the very same ones from `init_lora_weights`.

Adapter parameters keep peft's names under the HF module path, e.g.
`model.layers.3.self_attn.q_proj.lora_A.default.weight`; the adapted layer's own weight becomes
`...q_proj.base_layer.weight`. Export either merges (`merge_lora`: W + alpha/r · B·A, an ordinary HF
state dict) or writes a peft adapter folder (`save_adapter`) that `PeftModel.from_pretrained` loads.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

ADAPTER_NAME = "default"


def target_modules_for(config, target_modules) -> list[str]:
    """The module names to adapt: the configured ones, else peft's default for the model type."""
    if target_modules:
        return list(target_modules)
    # peft is optional (the `lora` extra): imported where LoRA is used, never by a full fine-tune
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    found = DEFAULTS.get(config.model_type)
    if not found:
        raise ValueError(
            f"adapter.target_modules: peft has no default LoRA targets for model type "
            f"{config.model_type!r}; list the linear layers to adapt (e.g. [q_proj, v_proj])"
        )
    return list(found)


def lora_config(config, adapter, transposed: bool = False, tokens: bool = True, vocab: bool = False):
    """The `peft.LoraConfig` of an `AdapterConfig` (what the adapter folder records): adapter.trainable_tokens
    become peft's `trainable_token_indices`, a list (the input embedding, its tied output layer following) for a
    tied model, else `{embedding module: ids, output module: ids}`; adapter.train_vocab makes the embedding and
    output modules peft's `modules_to_save` (whole trained copies). tokens=False: without them (injecting the
    adapters into a stage chunk, which has no vocabulary modules: the runtime trains those rows itself).
    vocab=True: the vocabulary modules are `modules_to_save` whatever trained (the adapter carries a vocabulary
    its named base does not have; their trained rows are in them, so no token indices)."""
    from peft import LoraConfig  # optional dependency (the `lora` extra)

    indices = save = None
    if tokens and getattr(adapter, "trainable_tokens", None) and not vocab:
        ids = list(adapter.trainable_tokens)
        embed, head = vocab_module_names(config)
        indices = ids if _tied(config) else {embed.rsplit(".", 1)[-1]: ids, head.rsplit(".", 1)[-1]: ids}
    if tokens and (adapter.train_vocab or vocab):  # the whole trained matrices, as peft's modules_to_save (tied: one)
        embed, head = vocab_module_names(config)
        save = [m.rsplit(".", 1)[-1] for m in ((embed,) if _tied(config) else (embed, head))]
    return LoraConfig(
        r=adapter.r,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=target_modules_for(config, adapter.target_modules),
        fan_in_fan_out=transposed,
        task_type="CAUSAL_LM",
        trainable_token_indices=indices,
        modules_to_save=save,
        ensure_weight_tying=bool(save) and _tied(config),
    )


def vocab_module_names(config) -> tuple[str, str]:
    """(HF module path of the input embedding, of the output layer), read from the model class built on the
    meta device (the output layer shares the embedding's weight when config.tie_word_embeddings)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {id(m): n for n, m in model.named_modules()}
    return names[id(model.get_input_embeddings())], names[id(model.get_output_embeddings())]


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def token_rows_from_state(state: dict[str, torch.Tensor], config, token_ids) -> dict[str, torch.Tensor]:
    """peft's `trainable_tokens_delta` tensors (the trained rows themselves, in `token_ids` order) under the
    names peft saves them, from a full HF state dict (tied: the embedding's only; the output layer shares it)."""
    embed, head = vocab_module_names(config)
    out = {}
    for module in (embed,) if _tied(config) else (embed, head):
        rows = state[f"{module}.weight"][list(token_ids)]
        out[f"base_model.model.{module}.token_adapter.trainable_tokens_delta"] = rows.contiguous()
    return out


def lora_modules(module: nn.Module, prefix_of=lambda name: name):
    """(HF module name, peft LoRA layer) for every adapted layer under `module`."""
    from peft.tuners.lora import LoraLayer  # optional dependency (the `lora` extra)

    for name, sub in module.named_modules():
        if isinstance(sub, LoraLayer):
            yield prefix_of(name), sub


def init_lora_weights(named_layers, seed: int, column_slices: dict | None = None) -> None:
    """peft's default init (A: Kaiming-uniform, B: zero), with A drawn from a generator seeded by
    (seed, HF module name): the same adapters whatever the pipeline layout, and in a plain peft model.
    `column_slices` (HF module name -> (TP rank, TP size)): an A that holds one TP rank's columns (a row-split
    layer's) is that part of the whole A's draw, so tensor parallelism starts from tp 1's adapters."""
    with torch.no_grad():
        for name, layer in named_layers:
            a = layer.lora_A[ADAPTER_NAME].weight
            g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            rank, size = (column_slices or {}).get(name, (0, 1))
            values = torch.empty((a.shape[0], a.shape[1] * size), dtype=torch.float32)
            nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=g)
            a.copy_(values[:, rank * a.shape[1] : (rank + 1) * a.shape[1]])
            layer.lora_B[ADAPTER_NAME].weight.zero_()


def split_adapters(chunk, named_local) -> dict[str, int]:
    """Tensor parallelism: fit the LoRA layers peft injected into a TP-split chunk (`named_local`: local module
    name -> LoRA layer). A column-split base (colwise) keeps A whole (its gradient a partial sum over TP) and B's
    rows of this rank (a fused projection's one part at a time); a row-split base (rowwise) keeps A's columns of
    this rank and B whole (its gradient a partial sum), and its g moves onto the wrapper, so that the base's and
    the adapter's partial outputs are summed together. The chunk's TP records follow peft's renaming of the base
    (`...q_proj.base_layer.weight`). Returns the local module names whose A holds a column slice."""
    from .tensor_parallel import move_leave

    sliced, partial, packed = chunk.tp_sliced, list(chunk.tp_partial), chunk.tp_packed
    columns = []
    for local, layer in named_local:
        old, new = f"{local}.", f"{local}.base_layer."
        for table in (sliced, packed):
            for key in [k for k in table if k.startswith(old) and not k.startswith(new)]:
                table[new + key[len(old) :]] = table.pop(key)
        partial = [new + n[len(old) :] if n.startswith(old) and not n.startswith(new) else n for n in partial]
        a, b = f"{local}.lora_A.{ADAPTER_NAME}.weight", f"{local}.lora_B.{ADAPTER_NAME}.weight"
        dim = sliced.get(f"{new}weight")
        if dim == 0:  # colwise
            sliced[b] = 0
            if f"{new}weight" in packed:
                packed[b] = packed[f"{new}weight"]
            partial.append(a)
        elif dim == 1:  # rowwise
            sliced[a] = 1
            partial.append(b)
            move_leave(layer.get_base_layer(), layer)
            columns.append(local)
        elif f"{new}weight" in partial:  # a whole layer whose gradient is a partial sum: so are its adapters'
            partial += [a, b]
    chunk.tp_partial = tuple(partial)
    return columns


def apply_lora(mods, adapter, seed: int, dtype: torch.dtype) -> list[str]:
    """Inject LoRA into the rank's stage chunks, freeze the rest (the vocabulary too unless
    `adapter.train_vocab`). Returns the HF names of adapted modules whose base is a transposed
    (GPT-2 Conv1D, fan_in_fan_out) linear layer, which merging must know."""
    from peft import inject_adapter_in_model  # optional dependency (the `lora` extra)

    transposed = []
    for chunk in mods.chunks.values():
        has_conv = any(isinstance(m, Conv1D) for m in chunk.modules())
        cfg = lora_config(mods.config, adapter, transposed=has_conv, tokens=False)
        try:
            inject_adapter_in_model(cfg, chunk, adapter_name=ADAPTER_NAME)
        except ValueError as e:  # peft: "Target modules {...} not found in the base model"
            raise ValueError(f"adapter.target_modules: {e}") from None
        chunk.to(dtype)
        named = list(lora_modules(chunk, lambda n, c=chunk: c.hf_name(f"{n}.x").rsplit(".", 1)[0]))
        columns = {}
        if chunk.tp is not None:  # tensor parallelism: the adapters split as their base layers are
            comm = chunk.tp.comm
            local = list(lora_modules(chunk))
            columns = {
                chunk.hf_name(f"{n}.x").rsplit(".", 1)[0]: (comm.rank, comm.size) for n in split_adapters(chunk, local)
            }
        init_lora_weights(named, seed, columns)
        transposed += [n for n, layer in named if isinstance(layer.get_base_layer(), Conv1D)]
        for name, p in chunk.named_parameters():
            p.requires_grad_(".lora_" in name)
    for p in (
        mods.embed_weight,
        mods.head_weight,
        mods.embed.weight if mods.embed else None,
        mods.head.weight if mods.head else None,
    ):
        if p is not None:
            p.requires_grad_(adapter.train_vocab or bool(adapter.trainable_tokens))
    if adapter.trainable_tokens and not adapter.train_vocab:
        mods.trained_rows = token_row_masks(mods, adapter.trainable_tokens)
    return transposed


def token_row_masks(mods, token_ids) -> dict:
    """id(vocabulary weight) -> (weight, [rows, 1] mask of the rows that train): the rows of `token_ids` in this
    rank's shard ("vocab" placement: each rank only its own rows), or in the full embedding / head
    ("baseline"). The weight's gradient is masked to them after every backward (`mask_row_grads`)."""
    out = {}
    weights = [(mods.embed_weight, 0), (mods.head_weight, 0)]
    if mods.partition is not None:
        start, _ = mods.partition.shard_range(mods.vocab_rank)
        weights = [(w, start) for w, _ in weights]
    for module in (mods.embed, mods.head):  # baseline; under TP its rows [start, ...) (TPEmbedding, TPHead)
        weights.append((module.weight if module else None, getattr(module, "start", 0)))
    for weight, start in weights:
        if weight is None or id(weight) in out:
            continue
        mask = torch.zeros(weight.shape[0], 1, dtype=torch.bool, device=weight.device)
        mask[[i - start for i in token_ids if 0 <= i - start < weight.shape[0]]] = True
        out[id(weight)] = (weight, mask)
    return out


def mask_row_grads(trained_rows: dict) -> None:
    """Zero the gradient of every vocabulary row that does not train (adapter.trainable_tokens): the rows that
    do keep exactly the gradient they would have in full training; AdamW then moves nothing else (zero moments,
    no weight decay on these weights: `optim.build_optimizer`)."""
    for weight, mask in trained_rows.values():
        if weight.grad is not None:
            weight.grad.mul_(mask)


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merge_lora(state: dict[str, torch.Tensor], scaling: float, transposed=()) -> dict[str, torch.Tensor]:
    """A plain HF state dict from one with adapters: W + scaling · B·A (transposed for fan_in_fan_out layers),
    `base_layer.` dropped from the names, the adapter tensors removed."""
    transposed = set(transposed)
    out = {}
    for name, t in state.items():
        if is_lora_name(name):
            continue
        if ".base_layer." not in name:
            out[name] = t
            continue
        module, _, leaf = name.partition(".base_layer.")
        if leaf == "weight":
            a_dtype = state[f"{module}.lora_A.{ADAPTER_NAME}.weight"].dtype
            a = state[f"{module}.lora_A.{ADAPTER_NAME}.weight"].double()
            b = state[f"{module}.lora_B.{ADAPTER_NAME}.weight"].double()
            delta = scaling * (b @ a)
            # a base held in the compute dtype (bf16) merges into the adapters' fp32: the update is not rounded
            t = (t.double() + (delta.t() if module in transposed else delta)).to(torch.promote_types(t.dtype, a_dtype))
        out[f"{module}.{leaf}"] = t
    return out


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors under the names peft saves (`base_model.model.<module>.lora_A.weight`)."""
    return {
        "base_model.model." + n.replace(f".{ADAPTER_NAME}.", "."): t.contiguous()
        for n, t in state.items()
        if is_lora_name(n)
    }


def save_adapter(
    state: dict[str, torch.Tensor],
    config,
    adapter,
    transposed,
    out_dir,
    base_model_name_or_path: str | None = None,
    tokenizer=None,
    vocab: bool = False,
) -> Path:
    """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors, and the tokenizer when
    given: `AutoPeftModelForCausalLM` reads it from the folder instead of asking the hub).

    `base_model_name_or_path` is what `AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads the base from
    (a hub id or a directory; without it, only `PeftModel.from_pretrained(base, out_dir)` works). `vocab`: the
    folder carries the run's embedding and output layer whole (peft's modules_to_save), for a base whose
    vocabulary the run resized or rebuilt (`lora_config`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = lora_config(config, adapter, transposed=bool(transposed), vocab=vocab)
    cfg.base_model_name_or_path = base_model_name_or_path
    cfg.save_pretrained(str(out))
    tensors = adapter_state_dict(state)
    if getattr(adapter, "trainable_tokens", None) and not vocab:  # peft's trainable_token_indices: the rows
        tensors.update(token_rows_from_state(state, config, adapter.trainable_tokens))
    if adapter.train_vocab or vocab:  # peft's modules_to_save: the modules whole, under their own names
        embed, head = vocab_module_names(config)
        for module in (embed, head):  # tied: the output layer's copy is the embedding (peft loads both)
            for leaf in ("weight", "bias"):
                t = state.get(f"{module}.{leaf}", state[f"{embed}.weight"] if leaf == "weight" else None)
                if t is not None:
                    tensors[f"base_model.model.{module}.{leaf}"] = t.clone()  # tied: one tensor per entry
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def parameter_counts(named_parameters, is_duplicate=lambda name: False, trained_rows=None) -> tuple[int, int]:
    """(trainable, total) parameters of one rank, a tied copy (`is_duplicate`) counted once over the ranks; of a
    weight that trains only some rows (`trained_rows`), those rows."""
    rows = {k: int(mask.sum()) * w.shape[1] for k, (w, mask) in (trained_rows or {}).items()}
    own = [
        (p.numel(), rows.get(id(p), p.numel() if p.requires_grad else 0))
        for n, p in named_parameters
        if not is_duplicate(n)
    ]
    return sum(t for _, t in own), sum(n for n, _ in own)


def describe_adapter(adapter, config, trainable: int, total: int) -> str:
    """The line a LoRA run starts with: what is adapted and how many parameters train."""
    vocab = (
        "trains (adapter.train_vocab)"
        if adapter.train_vocab
        else f"is frozen but the rows of {len(adapter.trainable_tokens)} tokens (adapter.trainable_tokens "
        f"{adapter.trainable_tokens})"
        if adapter.trainable_tokens
        else "is frozen"
    )
    targets = ", ".join(target_modules_for(config, adapter.target_modules))
    share = 100 * trainable / max(total, 1)
    return (
        f"LoRA r={adapter.r} alpha={adapter.alpha:g} on {targets}: {trainable:,} trainable of {total:,} "
        f"parameters ({share:.2f}%); the vocabulary {vocab}"
    )
