"""What makes an exported model ready for inference, checked without launching a run:

- every export writes the tokenizer's bos/eos/pad ids into config.json and generation_config.json, and
  generation also stops at the chat template's end-of-turn token;
- chat data on a tokenizer without a template: ChatML, with <|im_start|>/<|im_end|> added as special tokens
  whose rows each rank builds for its own shard (the mean of the old rows for pretrained weights, tied or
  not), and `--check` says so;
- a tokenizer swap keeps the model's chat template when the new tokenizer has none (its markers' rows
  copied), or says why not;
- the adapter folder names the model source as its base only when the run's frozen base is that model.
"""

import json
import random

import pytest
import torch
from test_train_vocab import build_and_export, sentences
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.tiny import tiny_config
from vp_accelerate.models import save_hf
from vp_accelerate.models.checkpoint_source import CheckpointSource, share_vocab_means
from vp_accelerate.models.generation import end_of_turn_id, generation_eos
from vp_accelerate.train.data.chat_template import CHATML_MARKERS, prepare_chat
from vp_accelerate.train.data.formats import CHATML_TEMPLATE
from vp_accelerate.train.recipe import DataSection, ModelSection, Recipe, TokenizerSection
from vp_accelerate.train.tokens.tokenizer import train_bpe
from vp_accelerate.train.tokens.vocab_plan import plan_vocab, prepare_tokenizers

CHAT = [{"role": "user", "content": "where is the cat"}, {"role": "assistant", "content": "on the mat"}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """Two byte-level BPEs without a chat template, trained on different text (so their ids differ)."""
    d = tmp_path_factory.mktemp("chat_tok")
    rng = random.Random(0)
    for name in ("a", "b"):
        (d / f"{name}.txt").write_text("\n".join(sentences(rng, 400)) + "\n")
    train_bpe([str(d / "a.txt")], 300, str(d / "tok_a"), min_frequency=2)
    train_bpe([str(d / "b.txt")], 280, str(d / "tok_b"), min_frequency=1)
    return d


def load(d, name):
    return AutoTokenizer.from_pretrained(str(d / name))


def chat_file(path, n=8):
    path.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(n)))
    return str(path)


def save_model(path, tokenizer, tie=False, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2, tie=tie)
    )
    save_hf(model.state_dict(), model.config, path, tokenizer=tokenizer)
    return model


def recipe(model_source, tok_source=None, files=None):
    return Recipe(
        model=ModelSection(source=str(model_source)),
        tokenizer=TokenizerSection(source=None if tok_source is None else str(tok_source)),
        data=DataSection(files=files or []),
    )


def test_export_writes_the_tokenizers_ids_and_stops_at_the_end_of_turn(toks, tmp_path):
    from transformers import GenerationConfig

    tok = load(toks, "tok_a")  # <|endoftext|> = 0 (EOS and BOS), <|pad|> = 1; the config says 1, 2 and 0
    config = tiny_config("llama", vocab_size=len(tok) + 2, hidden_size=32, num_layers=1)
    before = (config.bos_token_id, config.eos_token_id, config.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    save_hf(model.state_dict(), config, tmp_path / "plain", tokenizer=tok)
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (0, 0, 1) != before
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == before  # the caller's config
    gen = GenerationConfig.from_pretrained(tmp_path / "plain")
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (0, 0, 1)

    prepare_chat(tok, chat_data=True)  # ChatML: generation stops at <|im_end|> as well
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    save_hf(model.state_dict(), config, tmp_path / "chat", tokenizer=tok)
    assert GenerationConfig.from_pretrained(tmp_path / "chat").eos_token_id == [0, im_end]
    back = AutoTokenizer.from_pretrained(tmp_path / "chat")
    assert back.chat_template == CHATML_TEMPLATE and len(back) == len(tok)

    tok.bos_token, tok.pad_token = None, None  # as Qwen's BPE: no BOS; no pad token: generation pads with EOS
    save_hf(model.state_dict(), config, tmp_path / "nobos", tokenizer=tok)
    saved = json.loads((tmp_path / "nobos" / "config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (None, 0, None)
    assert GenerationConfig.from_pretrained(tmp_path / "nobos").pad_token_id == 0


@pytest.mark.parametrize(
    "template, markers, expected",
    [
        (CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
        (
            "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
            "{% endfor %}",
            ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
            "<|eot_id|>",
        ),  # Llama 3
        (
            "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}",
            ["<start_of_turn>", "<end_of_turn>"],
            "<end_of_turn>",
        ),  # Gemma
        ("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}", [], "<|endoftext|>"),  # EOS closes
        ("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", [], None),  # plain text
        ("{{ raise_exception('system turn required') }}", [], None),
    ],
)
def test_end_of_turn_token_of_a_template(toks, template, markers, expected):
    tok = load(toks, "tok_a")
    if markers:
        tok.add_special_tokens({"additional_special_tokens": markers})
    tok.chat_template = template
    eot = end_of_turn_id(tok)
    assert (tok.convert_ids_to_tokens(eot) if eot is not None else None) == expected
    assert generation_eos(tok) == (0 if expected in (None, "<|endoftext|>") else [0, eot])


@pytest.mark.parametrize("tie", [False, True])
def test_chatml_fallback_adds_special_tokens_with_rows_built_per_rank(toks, tmp_path, tie):
    model_tok = load(toks, "tok_a")
    ref = save_model(tmp_path / "m", model_tok, tie=tie)
    n = len(model_tok)
    r = recipe(tmp_path / "m", files=[chat_file(tmp_path / "chat.jsonl")])
    tok = load(toks, "tok_a")  # the tokenizer, named separately from the model's own (same vocabulary)
    chat = prepare_tokenizers(r, tok, model_tok, pretrained=True)
    assert (chat.kind, chat.added, chat.end_of_turn) == ("chatml", list(CHATML_MARKERS), "<|im_end|>")
    ids = tok.convert_tokens_to_ids(list(CHATML_MARKERS))
    assert ids == [n, n + 1] and len(tok) == n + 2
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok(text, add_special_tokens=False)["input_ids"][0] == n  # one token, not eight BPE pieces
    plan = plan_vocab(r, n, tok, True, model_tok, chat=chat)
    assert (plan.mode, plan.rows_after) == ("grow", n + 2)  # the model's rows by id, two new ones
    assert "<|im_start|>, <|im_end|> added as special tokens (2 new vocabulary rows)" in plan.lines()[-1]
    src = CheckpointSource.from_dir(tmp_path / "m", vocab_size=plan.rows_after, row_map=plan.row_map)
    share_vocab_means(src, 0, 1)
    back = build_and_export(src, tmp_path / "out")  # 2 ranks: rank 1's shard holds the new rows
    assert back.config.tie_word_embeddings == tie
    for got, old in (
        (back.get_input_embeddings().weight, ref.get_input_embeddings().weight),
        (back.get_output_embeddings().weight, ref.get_output_embeddings().weight),
    ):
        assert torch.equal(got[:n], old)
        torch.testing.assert_close(got[n:], old.mean(0).expand(2, -1), rtol=0, atol=1e-6)

    fresh = load(toks, "tok_a")  # a fresh model: the rows follow the grown tokenizer
    chat = prepare_tokenizers(recipe("llama-tiny", "x", r.data.files), fresh, None, pretrained=False)
    assert plan_vocab(recipe("llama-tiny", "x"), 4096, fresh, False, chat=chat).rows_after == n + 2
    text_data = load(toks, "tok_a")  # text data: no template, nothing added
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "the cat"}) + "\n")
    chat = prepare_tokenizers(recipe("llama-tiny", "x", [str(tmp_path / "text.jsonl")]), text_data, None, False)
    assert chat.kind == "none" and chat.line() is None and len(text_data) == n


def test_check_says_the_chatml_tokens_are_added(toks, tmp_path, capsys):
    from vp_accelerate.train.cli.commands import train_main

    (tmp_path / "r.yaml").write_text(
        json.dumps(
            {
                "model": {"source": "llama-tiny"},
                "tokenizer": {"source": f"bpe:{toks / 'tok_a'}"},
                "data": {"files": [chat_file(tmp_path / "chat.jsonl", 40)], "seq_len": 32},
                "pipeline": {"microbatches": 2},
                "train": {"global_batch": 2},
                "eval": {"batches": 0},
            }
        )
    )
    assert train_main([str(tmp_path / "r.yaml"), "--check", "--world-size", "2"]) == 0
    err = capsys.readouterr().err
    n = len(load(toks, "tok_a"))
    assert f"vocabulary: tokenizer {n + 2:,} tokens, rows 4,096 -> {n + 2:,}" in err
    assert (
        "chat template: ChatML (the tokenizer has none); <|im_start|>, <|im_end|> added as special tokens (2 new "
        "vocabulary rows); generation stops at <|im_end|>; saved with the tokenizer" in err
    )


def test_a_swap_keeps_the_models_chat_template(toks, tmp_path):
    model_tok = load(toks, "tok_a")
    prepare_chat(model_tok, chat_data=True)  # the model was chat-trained: ChatML with its own marker tokens
    ref = save_model(tmp_path / "m", model_tok)
    new = load(toks, "tok_b")
    r = recipe(tmp_path / "m", toks / "tok_b", [chat_file(tmp_path / "chat.jsonl")])
    chat = prepare_tokenizers(r, new, model_tok, pretrained=True)
    assert (chat.kind, chat.added) == ("model", list(CHATML_MARKERS))
    assert new.chat_template == model_tok.chat_template and "kept across the tokenizer swap" in chat.line()
    plan = plan_vocab(r, len(model_tok), new, True, model_tok, chat=chat)
    assert plan.mode == "swap"
    src = CheckpointSource.from_dir(tmp_path / "m", vocab_size=plan.rows_after, row_map=plan.row_map)
    share_vocab_means(src, 0, 1)
    back = build_and_export(src, tmp_path / "out")
    for marker in CHATML_MARKERS:  # the markers' trained rows come along, in both matrices
        i, j = new.convert_tokens_to_ids(marker), model_tok.convert_tokens_to_ids(marker)
        assert torch.equal(back.get_input_embeddings().weight[i], ref.get_input_embeddings().weight[j])
        assert torch.equal(back.get_output_embeddings().weight[i], ref.get_output_embeddings().weight[j])

    # why not: neither tokenizer has a template (text data: nothing to add; chat data: ChatML)
    plain = load(toks, "tok_a")
    chat = prepare_chat(load(toks, "tok_b"), plain, chat_data=False, swap=True)
    assert (
        chat.line() == "chat template: none (neither the new tokenizer nor the model's has a chat template; "
        "the data is not chat)"
    )
    chat = prepare_tokenizers(r, load(toks, "tok_b"), plain, pretrained=True)
    assert chat.kind == "chatml" and "neither the new tokenizer nor the model's" in chat.line()


def test_the_adapter_folder_names_the_model_source_only_when_it_is_the_runs_base(toks, tmp_path):
    from vp_accelerate.train.persist.hf_export import adapter_base

    tok = load(toks, "tok_a")
    save_model(tmp_path / "m", tok)
    lora = {"type": "lora"}
    same = {"model": {"source": str(tmp_path / "m"), "pretrained_weights": True}, "adapter": lora}
    # a local directory is a path of this machine: the base is written beside the adapter (None), unless it
    # is a directory of the hub's cache, whose hub id is named instead
    assert adapter_base(same, len(tok), tok)[0] is None
    snapshot = tmp_path / "hub" / "models--org--tiny-model" / "snapshots" / "0123abc"
    save_model(snapshot, tok)
    same = {"model": {"source": str(snapshot), "pretrained_weights": True}, "adapter": lora}
    assert adapter_base(same, len(tok), tok)[0] == "org/tiny-model"
    assert adapter_base({"model": {"source": "llama-tiny"}}, len(tok), tok)[0] is None  # a fresh model
    base, why, _ = adapter_base(same, len(tok) + 2, tok)  # rows past the tokenizer: peft cannot grow the base so
    assert base is None and "neither" in why
    grown = load(toks, "tok_a")
    grown.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})  # resized to the tokenizer: the hub id,
    assert adapter_base(same, len(grown), grown) == ("org/tiny-model", adapter_base(same, len(grown), grown)[1], True)
    chat_tok = load(toks, "tok_a")
    prepare_chat(chat_tok, chat_data=True)  # ChatML tokens added: not the source's vocabulary
    assert adapter_base(same, len(tok), chat_tok)[0] is None
    templated = load(toks, "tok_a")
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    assert adapter_base(same, len(tok), templated)[0] is not None  # the same stops (EOS closes a turn)
    overridden = {"model": {**same["model"], "config": {"num_hidden_layers": 1}}}
    assert adapter_base(overridden, len(tok), tok)[0] is None
    assert adapter_base({"model": {"source": "./no/such/dir"}}, len(tok), tok)[0] is None


def test_stop_at_says_where_the_run_stopped(toks, tmp_path, monkeypatch, caplog):
    """The closing line of a run cut short by --stop-at: where it stopped and how to go on (not "done")."""
    import dataclasses
    import logging
    import types

    from vp_accelerate.train.cli.commands import train_main
    from vp_accelerate.train.run import trainer

    # the run as setup resolves it: the recipe with its checkpoint directory filled in
    monkeypatch.setattr(
        trainer,
        "setup",
        lambda recipe, **k: types.SimpleNamespace(
            recipe=dataclasses.replace(
                recipe,
                checkpoint=dataclasses.replace(
                    recipe.checkpoint, dir=recipe.checkpoint.resolved_dir(recipe.logging.output_dir)
                ),
            )
        ),
    )
    monkeypatch.setattr(trainer, "train", lambda recipe, **k: {"end_step": 4, "final_eval_loss": 1.5, "hf_dir": None})
    (tmp_path / "r.yaml").write_text(
        json.dumps(
            {
                "model": {"source": "llama-tiny"},
                "tokenizer": {"source": f"bpe:{toks / 'tok_a'}"},
                "data": {"files": [chat_file(tmp_path / "chat.jsonl", 40)], "seq_len": 32},
                "pipeline": {"microbatches": 2},
                "train": {"steps": 10, "global_batch": 2},
                "eval": {"batches": 0},
                "logging": {"wandb_mode": "disabled", "output_dir": str(tmp_path / "run")},
            }
        )
    )
    with caplog.at_level(logging.INFO, logger="vp_accelerate.train"):
        assert train_main([str(tmp_path / "r.yaml"), "--stop-at", "4"]) == 0
    where = tmp_path / "run" / "checkpoints"
    assert (
        f"stopped after step 4 of 10 (--stop-at 4): eval loss 1.5000; checkpoint {where}; continue with --resume; "
        f"no final export" in caplog.text
    )
    assert "done:" not in caplog.text
