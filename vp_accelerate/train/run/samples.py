"""Sample generations at evaluation (`eval.prompts`): what the model answers now, greedily.

The pipeline computes losses, not logits (the output layer is split over every rank and never forms the
logits of a whole sequence), so the model is gathered once per evaluation onto rank 0
(`PipelineModel.gather_hf_state_dict`, a collective; LoRA adapters merged), rebuilt as the plain HF model
it exports as, and completes every prompt with HF `generate` (greedy, up to eval.max_new_tokens, stopping
at EOS and the chat template's end of turn). The completions are exactly what the exported model
would answer. Chat data renders each prompt as a user turn with the training template and its generation
prompt; other formats complete the prompt text as it is.

Rank 0 holds one more full copy of the model while it generates (on its GPU when that copy fits in half
the free memory, else on CPU); the other ranks wait at their next collective.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM

from vp_accelerate.models.generation import generation_eos
from vp_accelerate.models.lora import merge_lora

from ..data.formats import chat_template_of
from .tracking import gather

log = logging.getLogger("vp_accelerate.train")


def prompt_ids(tokenizer, prompt: str, fmt: str, system: str | None = None) -> list[int]:
    """Token ids a prompt is completed from: a user turn with the generation prompt (chat; after the `system`
    turn, data.system_prompt, as training saw it; the template's special tokens only), or the text with the
    tokenizer's own special tokens (a BOS where it adds one, as training rows start)."""
    if fmt == "chat":
        turns = [{"role": "system", "content": system}] if system is not None else []
        text = tokenizer.apply_chat_template(
            turns + [{"role": "user", "content": prompt}],
            tokenize=False,
            chat_template=chat_template_of(tokenizer)[0],
            add_generation_prompt=True,
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def hf_model(config, state: dict, dtype: torch.dtype = torch.float32):
    """The plain HF model of a gathered state dict (non-persistent buffers such as rotary frequencies are
    computed by the model's own constructor, so it is built on CPU, not on the meta device)."""
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = (
        model.get_output_embeddings() is not None
        and model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(
            f"the gathered state dict does not match {type(model).__name__}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    if tied:
        model.tie_weights()
    return model.eval()


def _device_for(model) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    free, _ = torch.cuda.mem_get_info()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return torch.device("cuda", torch.cuda.current_device()) if size < free / 2 else torch.device("cpu")


@torch.no_grad()
def greedy(model, tokenizer, ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate` without sampling: the new token ids (up to the first stop token, included)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=generation_eos(tokenizer),
        pad_token_id=pad,
    )
    return out[0, len(ids) :].tolist()


def complete(
    pipe, tokenizer, prompts: list[str], fmt: str, max_new_tokens: int, system: str | None = None
) -> list[str] | None:
    """Greedy completions of `prompts` by the pipeline's current weights, on rank 0 (None on the others; chat
    prompts after the `system` turn if given). A collective: every rank of the pipeline calls it."""
    state = pipe.gather_hf_state_dict()  # on each replica's first pipeline rank; the others get None
    transposed = sorted({n for names in gather(list(getattr(pipe, "lora_transposed", []))) for n in names})
    if pipe.rank != 0:
        return None
    if pipe.adapter.enabled:
        state = merge_lora(state, pipe.adapter.scaling, transposed)
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    model = hf_model(pipe.hf_config, state, dtypes.pop() if len(dtypes) == 1 else torch.float32)
    del state
    model.to(_device_for(model))
    try:
        texts = []
        for prompt in prompts:
            new = greedy(model, tokenizer, prompt_ids(tokenizer, prompt, fmt, system), max_new_tokens)
            texts.append(tokenizer.decode(new, skip_special_tokens=True))
        return texts
    finally:
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def log_samples(run, step: int) -> None:
    """eval.prompts completed at this evaluation, logged as the wandb table `eval/samples` and to metrics.jsonl
    (rank 0). A collective."""
    e = run.recipe.eval
    fmt = run.data.fmt if run.data is not None else "text"
    texts = complete(run.pipe, run.tokenizer, e.prompts, fmt, e.max_new_tokens, run.recipe.data.system_prompt)
    if texts is not None:
        run.tracker.log_samples([{"prompt": p, "completion": c} for p, c in zip(e.prompts, texts)], step)
