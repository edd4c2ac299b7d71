"""LoRA under the pipeline is peft's LoRA: three AdamW steps on 2 gloo ranks match single-process peft
training of the same model (same adapters: both initialised from (seed, module name)), loss by loss and
weight by weight, in float64; frozen weights stay put and get no optimizer state; both exports (merged HF
model, peft adapter folder; with a trained vocabulary, its matrices as modules_to_save) reproduce the trained
model's logits."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn

pytest.importorskip("peft", reason="LoRA needs the lora extra (pip install peft)")

# (schedule, method, train_vocab): adapters only under four schedules, and with the vocabulary trained too
CONFIGS = [
    ("1f1b", "vocab-2", False),
    ("vhalf", "vocab-1", False),
    ("vhalf", "baseline", False),
    ("interleaved", "vocab-2", False),
    ("1f1b", "vocab-1", True),
    ("vhalf", "baseline", True),
]
TARGETS = ["q_proj", "v_proj", "down_proj"]
STEPS, LR, SEED = 3, 1e-2, 7


def _adam(params):
    return torch.optim.AdamW(params, lr=LR, eps=1e-6, weight_decay=0.0)


def _batches(seed: int, vocab: int, rows: int, seq: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (rows, seq), generator=g)
        labels = ids.clone()
        labels[0, seq // 2 :] = -100
        out.append((ids, labels))
    return out


def _reference(ckpt: str, batches, train_vocab: bool):
    from peft import LoraConfig, get_peft_model

    from vp_accelerate.models.lora import init_lora_weights, lora_modules

    base = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    init_lora_weights(lora_modules(model, lambda n: n.removeprefix("base_model.model.")), SEED)
    if train_vocab:
        for p in (base.get_input_embeddings().weight, base.get_output_embeddings().weight):
            p.requires_grad_(True)
    opt = _adam([p for p in model.parameters() if p.requires_grad])
    losses = []
    for ids, labels in batches:
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n.removeprefix("base_model.model."): p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, model


def _train_on_ranks(ckpt: str, batches, configs, out_dir: str):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.adapter_config import AdapterConfig
    from vp_accelerate.train.recipe import OptimizerSection
    from vp_accelerate.train.run.optim import build_optimizer

    results = {}
    for schedule, method, train_vocab in configs:
        adapter = AdapterConfig(type="lora", r=4, alpha=8, target_modules=TARGETS, train_vocab=train_vocab)
        pipe = PipelineModel(
            ckpt,
            PipelineConfig(schedule=schedule, method=method, microbatches=4, attn_implementation="eager"),
            dtype=torch.float64,
            seed=SEED,
            adapter=adapter,
        )
        opt = build_optimizer(pipe, OptimizerSection(lr=LR, eps=1e-6, weight_decay=0.0, betas=[0.9, 0.999]))
        losses = []
        for ids, labels in batches:
            losses.append(pipe.train_step(ids, labels).loss)
            pipe.clip_grad_norm_(0.0)
            opt.step()
            pipe.zero_grad()
        trainable = {n for n, p in pipe.named_parameters() if p.requires_grad}
        with_state = {n for n, p in pipe.named_parameters() if p in opt.state}
        results[(schedule, method, train_vocab)] = (losses, pipe.gather_hf_state_dict(), trainable, with_state)
        if (schedule, method, train_vocab) == configs[0]:
            pipe.export_hf(f"{out_dir}/merged")
            pipe.export_adapter(f"{out_dir}/adapter", base_model_name_or_path=ckpt)
        elif train_vocab and method == "vocab-1":  # the trained vocabulary: peft's modules_to_save
            pipe.export_adapter(f"{out_dir}/vocab_adapter", base_model_name_or_path=ckpt)
        pipe.close()
    return results


def test_lora_matches_single_process_peft(tmp_path, monkeypatch):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    config = tiny_llama(101)
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    batches = _batches(seed, 101, rows=4, seq=8)
    per_rank = spawn(_train_on_ranks, 2, ckpt, batches, CONFIGS, str(tmp_path), timeout_s=600)
    refs = {tv: _reference(ckpt, batches, tv) for tv in (False, True)}
    for key in CONFIGS:
        ref_losses, ref_params, _ = refs[key[2]]
        losses, params, _, _ = per_rank[0][key]
        assert losses == pytest.approx(ref_losses, rel=1e-9), (key, seed)
        assert set(params) == set(ref_params), key
        for name, ref in ref_params.items():
            torch.testing.assert_close(
                params[name], ref, rtol=1e-8, atol=1e-10, msg=lambda m: f"{key} {name} (seed {seed}): {m}"
            )
        vocab = set()
        for r in range(2):  # optimizer state for exactly the trainable parameters, LoRA's (+ vocabulary)
            _, _, trainable, with_state = per_rank[r][key]
            assert trainable == with_state and trainable
            vocab |= {n for n in trainable if "embed_tokens" in n or "lm_head" in n}
            assert all(".lora_" in n or "embed_tokens" in n or "lm_head" in n for n in trainable)
        assert vocab == ({"model.embed_tokens.weight", "lm_head.weight"} if key[2] else set()), key
    ref_model = refs[False][2]
    ids = batches[0][0]
    # eager attention takes its softmax in float32: merged W + BA and W x + B(Ax) differ in the last float64
    # bits, which can move a float32 softmax by an ulp — hence 1e-6, not float64's 1e-12
    with torch.no_grad():
        expected = ref_model(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "merged"), attn_implementation="eager", dtype=torch.float64
        )
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-6, atol=1e-6)
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
        loaded = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
        assert loaded.peft_config["default"].r == 4
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-9, atol=1e-9)
        # adapter.train_vocab: the trained embedding and output layer saved whole (modules_to_save)
        base = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
        loaded = PeftModel.from_pretrained(base, str(tmp_path / "vocab_adapter"))
        assert sorted(loaded.peft_config["default"].modules_to_save) == ["embed_tokens", "lm_head"]
        vocab_expected = refs[True][2](input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, vocab_expected, rtol=1e-9, atol=1e-9)

        # the final export of a run without checkpoints, from the gathered state: merged hf/ and the adapter
        # folder, whose fresh base (exists nowhere else) goes to adapter/base; AutoPeftModel loads it as it is
        from peft import AutoPeftModelForCausalLM

        from vp_accelerate.train.persist.hf_export import write_exports

        recipe = {
            "model": {"source": "llama-tiny"},
            "adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": TARGETS},
        }
        write_exports(
            per_rank[0][CONFIGS[0]][1],
            config,
            None,
            recipe,
            [],
            str(tmp_path / "final_hf"),
            str(tmp_path / "final_adapter"),
        )
        # the base is named relative to the folder (never a path of this machine): a copy loads elsewhere
        copy = shutil.copytree(tmp_path / "final_adapter", tmp_path / "elsewhere" / "adapter")
        shutil.rmtree(tmp_path / "final_adapter")
        monkeypatch.chdir(copy)
        auto = AutoPeftModelForCausalLM.from_pretrained(".", attn_implementation="eager", dtype=torch.float64)
        assert auto.peft_config["default"].base_model_name_or_path == "base"
        torch.testing.assert_close(auto(input_ids=ids).logits, expected, rtol=1e-9, atol=1e-9)
        final = AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "final_hf"), attn_implementation="eager", dtype=torch.float64
        )
        torch.testing.assert_close(final(input_ids=ids).logits, expected, rtol=1e-6, atol=1e-6)


# untied: both matrices' rows train; tied: one matrix (one shard, or the embedding and head of two ranks)
TOKEN_CONFIGS = {False: [("1f1b", "vocab-2"), ("vhalf", "baseline")], True: [("1f1b", "vocab-1"), ("1f1b", "baseline")]}


def _row_grads(pipe, tokens) -> dict:
    """(HF name, token id) -> that row's gradient on this rank, LoRA name -> gradient, and (HF name, "rest") ->
    the largest gradient outside the trained rows (must be 0)."""
    m, out = pipe.mods, {}
    for name, p in pipe.named_parameters():
        if p.grad is None:
            continue
        if ".lora_" in name:
            out[name] = p.grad.clone()
            continue
        start = m.partition.shard_range(m.rank)[0] if name in m.sharded_names else 0
        mine = [t for t in tokens if 0 <= t - start < p.shape[0]]
        for t in mine:
            out[(name, t)] = p.grad[t - start].clone()
        rest = torch.ones(p.shape[0], dtype=torch.bool)
        rest[[t - start for t in mine]] = False
        out[(name, "rest")] = float(p.grad[rest].abs().max()) if rest.any() else 0.0
    return out


def _token_rows_on_ranks(ckpt: str, batches, tokens, out_dir: str, configs):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.runtime.adapter_config import AdapterConfig
    from vp_accelerate.train.recipe import OptimizerSection
    from vp_accelerate.train.run.optim import build_optimizer

    results = {}
    for schedule, method in configs:
        adapter = AdapterConfig(type="lora", r=4, alpha=8, target_modules=TARGETS, trainable_tokens=tokens)
        pipe = PipelineModel(
            ckpt,
            PipelineConfig(schedule=schedule, method=method, microbatches=4, attn_implementation="eager"),
            dtype=torch.float64,
            seed=SEED,
            adapter=adapter,
        )
        opt = build_optimizer(
            pipe,
            OptimizerSection(lr=LR, eps=1e-6, weight_decay=0.1, betas=[0.9, 0.999]),
            pipe.mods.trained_rows,
        )
        losses, grads = [], None
        for ids, labels in batches:
            losses.append(pipe.train_step(ids, labels).loss)
            grads = grads if grads is not None else _row_grads(pipe, tokens)
            opt.step()
            pipe.zero_grad()
        results[(schedule, method)] = (losses, grads, pipe.gather_hf_state_dict())
        if (schedule, method) == configs[0]:
            pipe.export_adapter(f"{out_dir}/token_adapter", base_model_name_or_path=ckpt)
        pipe.close()
    return results


@pytest.mark.parametrize("tied", [False, True])
def test_trainable_token_rows_match_peft_trainable_token_indices(tmp_path, tied):
    """LoRA with adapter.trainable_tokens on 2 ranks (101 rows: shards of 51 and 50; tokens in both) against
    single-process peft with `trainable_token_indices` on the embedding and the output layer, float64: the loss
    of every step, the first step's gradient of every trained row (peft's `trainable_tokens_delta`) and of every
    adapter, no gradient on the other rows, and after three AdamW steps (weight decay on, which must not move
    the frozen rows) the same weights; peft loads the exported adapter folder and gives the same logits."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from vp_accelerate.models.lora import init_lora_weights, lora_modules
    from vp_accelerate.train.persist.hf_export import write_exports

    seed = random.randrange(2**31)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    config = tiny_llama(101, tied=tied)
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)
    tokens = rng.sample(range(0, 51), 2) + rng.sample(range(51, 101), 2)
    batches = _batches(seed, 101, rows=4, seq=8)
    for ids, _ in batches:  # the trained tokens occur as inputs and as targets
        ids[:, 1] = torch.tensor(tokens)
    configs = TOKEN_CONFIGS[tied]
    per_rank = spawn(_token_rows_on_ranks, 2, ckpt, batches, tokens, str(tmp_path), configs, timeout_s=600)

    base = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=TARGETS,
        trainable_token_indices=tokens if tied else {"embed_tokens": tokens, "lm_head": tokens},
    )
    model = get_peft_model(base, lora)
    init_lora_weights(lora_modules(model, lambda n: n.removeprefix("base_model.model.")), SEED)
    params = dict(model.named_parameters())
    deltas = {
        "model.embed_tokens.weight": params[
            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta.default"
        ]
    }
    if not tied:  # tied: the output layer shares the embedding's adapter (and its delta)
        deltas["lm_head.weight"] = params["base_model.model.lm_head.token_adapter.trainable_tokens_delta.default"]
    decay = [p for n, p in params.items() if p.requires_grad and ".lora_" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": list(deltas.values()), "weight_decay": 0.0}],
        lr=LR,
        eps=1e-6,
    )
    ref_losses, ref_grads = [], None
    for ids, labels in batches:
        logits = model(input_ids=ids).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        loss.backward()
        if ref_grads is None:
            ref_grads = {
                n.removeprefix("base_model.model."): p.grad.clone() for n, p in params.items() if ".lora_" in n
            }
            ref_grads.update({(n, t): d.grad[i].clone() for n, d in deltas.items() for i, t in enumerate(tokens)})
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    original = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64).state_dict()
    for key in configs:
        losses, _, state = per_rank[0][key]
        assert losses == pytest.approx(ref_losses, rel=1e-9), (key, seed)
        grads = {**per_rank[0][key][1], **per_rank[1][key][1]}
        for name, ref in ref_grads.items():
            got = grads[name]
            torch.testing.assert_close(got, ref, rtol=1e-8, atol=1e-12, msg=lambda m: f"{key} {name} ({seed}): {m}")
        assert all(v == 0.0 for k, v in grads.items() if isinstance(k, tuple) and k[1] == "rest"), key
        for name, delta in deltas.items():
            trained = state[name][tokens]
            torch.testing.assert_close(trained, delta.detach(), rtol=1e-8, atol=1e-10)
            rest = [i for i in range(101) if i not in tokens]
            assert torch.equal(state[name][rest], original[name][rest]), (key, name)  # frozen rows stay exactly

    ids = batches[0][0]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float64),
            str(tmp_path / "token_adapter"),
        )
        indices = tokens if tied else {"embed_tokens": tokens, "lm_head": tokens}
        assert loaded.peft_config["default"].trainable_token_indices == indices
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-9, atol=1e-9)
        recipe = {
            "model": {"source": "llama-tiny"},
            "adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": TARGETS, "trainable_tokens": tokens},
        }
        write_exports(per_rank[0][configs[1]][2], config, None, recipe, [], None, str(tmp_path / "final"))
        from peft import AutoPeftModelForCausalLM

        here = os.getcwd()
        os.chdir(tmp_path / "final")  # the frozen base is written beside the adapter, named relative to it: "base"
        try:
            auto = AutoPeftModelForCausalLM.from_pretrained(".", attn_implementation="eager", dtype=torch.float64)
        finally:
            os.chdir(here)
        torch.testing.assert_close(auto(input_ids=ids).logits, expected, rtol=1e-9, atol=1e-9)


def _gpt2_on_ranks(ckpt: str, ids, out: str):
    from vp_accelerate.runtime import AdapterConfig, PipelineConfig, PipelineModel

    pipe = PipelineModel(
        ckpt,
        PipelineConfig(schedule="1f1b", method="vocab-2", microbatches=2),
        dtype=torch.float64,
        seed=SEED,
        adapter=AdapterConfig(type="lora", r=4, alpha=8),
    )  # peft's default: c_attn
    pipe.train_step(ids, ids.clone())  # with GPT-2's dropout on: training mode
    with torch.no_grad():
        for p in pipe.trainable_parameters():
            p -= 0.5 * p.grad
    pipe.export_hf(f"{out}/merged")
    pipe.export_adapter(f"{out}/adapter", base_model_name_or_path=ckpt)
    return pipe.eval_step(ids, ids.clone())


def test_gpt2_conv1d_adapters_merge_transposed_and_eval_without_dropout(tmp_path):
    """GPT-2's Conv1D layers hold W transposed (peft's fan_in_fan_out): the merged export must add (BA)^T,
    whichever rank holds the layer; evaluation runs without dropout, as HF's eval mode."""
    from peft import PeftModel
    from transformers import GPT2Config

    torch.manual_seed(random.randrange(2**31))
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    ).save_pretrained(ckpt)
    ids = torch.randint(0, 97, (2, 8))
    evals = spawn(_gpt2_on_ranks, 2, ckpt, ids, str(tmp_path), timeout_s=600)
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float64)
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float64), str(tmp_path / "adapter")
        )
        logits = loaded(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, logits, rtol=1e-9, atol=1e-9)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    assert evals[0] == evals[1] == pytest.approx(loss.item(), rel=1e-10)
    assert not torch.allclose(
        merged.transformer.h[0].attn.c_attn.weight,
        AutoModelForCausalLM.from_pretrained(ckpt).transformer.h[0].attn.c_attn.weight.double(),
    )
