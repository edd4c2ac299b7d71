"""The vocabulary decision and the meaning-preserving tokenizer swap.

- the model's own tokenizer is the default; rows past the tokenizer are kept unless allow_shrink;
  `--check` prints the decision;
- a swap copies the rows of shared tokens exactly (embedding and lm_head, or the tied matrix) and
  composes new tokens from the old tokenizer's pieces;
- after a swap, a briefly trained model keeps most of what it learned: its loss under the new
  tokenizer is far below both ln(V) and the loss of the same swap done by id (what keeping rows by id
  gives), on fresh text.
"""

import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_config
from vp_accelerate.models import StageLayout, assemble_state_dict, build_rank, save_hf
from vp_accelerate.models.checkpoint_source import CheckpointSource, share_vocab_means
from vp_accelerate.models.row_map import COMPOSED, COPY, MEAN, RowMap
from vp_accelerate.train.recipe import ModelSection, Recipe, RecipeError, TokenizerSection
from vp_accelerate.train.tokens.token_map import token_bytes
from vp_accelerate.train.tokens.tokenizer import EOS, PAD, train_bpe
from vp_accelerate.train.tokens.vocab_plan import plan_vocab, tokenizer_source
from vp_accelerate.vocab.partition import VocabPartition

WORDS = {
    "en": "the cat sat on a mat and then it ran far away from home".split(),
    "ru": "кот сидел на коврике потом убежал далеко от дома".split(),
    "el": "η γάτα κάθισε στο χαλί και μετά έφυγε μακριά".split(),
}


def sentences(rng: random.Random, n: int) -> list[str]:
    """Text with structure a tiny model learns in seconds: each sentence walks one language's word list."""
    out = []
    for _ in range(n):
        words = WORDS[rng.choice(sorted(WORDS))]
        start = rng.randrange(len(words) - 4)
        out.append(" ".join(words[start : start + rng.randint(4, len(words) - start)]) + ".")
    return out


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Tokenizer A (the model's); B (another: different data and special tokens, so ids differ) and C (as B,
    larger: whole-word tokens that A only has as pieces)."""
    d = tmp_path_factory.mktemp("vocab")
    rng = random.Random(0)
    for name, n in (("a", 600), ("b", 600)):
        (d / f"{name}.txt").write_text("\n".join(sentences(rng, n)) + "\n")
    tok_a = train_bpe([str(d / "a.txt")], 300, str(d / "tok_a"), min_frequency=2)
    specials = (EOS, PAD, "<|im_start|>", "<|im_end|>")
    tok_b = train_bpe([str(d / "b.txt")], 300, str(d / "tok_b"), min_frequency=1, special_tokens=specials)
    tok_c = train_bpe([str(d / "b.txt")], 420, str(d / "tok_c"), min_frequency=1, special_tokens=specials)
    return d, tok_a, tok_b, tok_c


def recipe(model_source, tok_source=None, **tok):
    return Recipe(
        model=ModelSection(source=str(model_source)),
        tokenizer=TokenizerSection(source=None if tok_source is None else str(tok_source), **tok),
    )


def save_model(path, tokenizer, tie=False, seed=0, **cfg):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(
            "llama", vocab_size=cfg.pop("vocab_size", len(tokenizer)), hidden_size=64, num_layers=2, tie=tie, **cfg
        )
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def build_and_export(source, out_dir, ranks=2):
    """Every rank's modules (vocabulary shards) gathered into one HF model, as export does."""
    layout = StageLayout.one_per_rank(2, ranks)
    part = VocabPartition(source.config.vocab_size, ranks)
    rms = [build_rank(source, layout, r, "vocab", part) for r in range(ranks)]
    sds = [{n: t for n, t in rm.state_dict().items() if not rm.is_duplicate(n)} for rm in rms]
    return AutoModelForCausalLM.from_pretrained(
        save_hf(assemble_state_dict(sds, rms[0].vocab_size, rms[0].sharded_names), rms[0].config, out_dir)
    )


def swap_source(model_dir, old_tok, new_tok, by_token=True, **tok):
    r = recipe(model_dir, "other", **tok)
    if not by_token:
        r.tokenizer.remap = "by_id"
    plan = plan_vocab(r, len(old_tok), new_tok, True, old_tok if by_token else None)
    src = CheckpointSource.from_dir(
        model_dir, vocab_size=plan.rows_after, row_map=plan.row_map or RowMap.identity(plan.rows_after, len(old_tok))
    )
    share_vocab_means(src, 0, 1)
    return plan, src


def test_tokenizer_defaults_to_the_models_own(tmp_path, corpora):
    d, tok_a, *_ = corpora
    save_model(tmp_path / "m", tok_a)
    assert tokenizer_source(recipe(tmp_path / "m")) == str(tmp_path / "m")
    assert tokenizer_source(recipe(tmp_path / "m", "qwen")) == "qwen"
    with pytest.raises(RecipeError, match=r"tokenizer.source: not set, and model.source 'llama-tiny' is a preset"):
        tokenizer_source(recipe("llama-tiny"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(RecipeError, match="has no tokenizer files"):
        tokenizer_source(recipe(tmp_path / "bare"))


def test_rows_past_the_tokenizer_are_kept_unless_allowed(tmp_path, corpora):
    d, tok_a, *_ = corpora
    rows = len(tok_a) + 37  # a checkpoint padded past its tokenizer (as Qwen's 151,936 rows for 151,665 tokens)
    save_model(tmp_path / "m", tok_a, vocab_size=rows)
    keep = plan_vocab(recipe(tmp_path / "m"), rows, tok_a, True, tok_a)
    assert (keep.mode, keep.rows_after, keep.padding) == ("keep", rows, 37)
    assert "allow_shrink" in keep.reason
    shrink = plan_vocab(recipe(tmp_path / "m", allow_shrink=True, pad_to_multiple_of=64), rows, tok_a, True, tok_a)
    assert (shrink.mode, shrink.rows_after) == ("shrink", 320)
    fresh = plan_vocab(recipe("llama-tiny", "x"), 4096, tok_a, False)
    assert (fresh.mode, fresh.rows_after) == ("fresh", len(tok_a))
    with pytest.raises(RecipeError, match="tokenizer.resize_vocab: the tokenizer has"):
        plan_vocab(recipe(tmp_path / "m", resize_vocab=False), len(tok_a) - 5, tok_a, True, tok_a)
    # kept rows come back unchanged, the padded tail included
    src = CheckpointSource.from_dir(tmp_path / "m")
    back = build_and_export(src, tmp_path / "out")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert torch.equal(back.get_input_embeddings().weight, ref.get_input_embeddings().weight)


def test_check_prints_the_vocabulary_decision(tmp_path, corpora, capsys):
    from vp_accelerate.train.cli.commands import train_main

    d, tok_a, tok_b, _ = corpora
    save_model(tmp_path / "m", tok_a, vocab_size=len(tok_a) + 4)
    texts = sentences(random.Random(1), 50)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "r.yaml").write_text(
        json.dumps(
            {
                "model": {"source": str(tmp_path / "m")},
                "data": {"files": [str(tmp_path / "data.jsonl")], "seq_len": 32},
                "train": {"global_batch": 8},
                "eval": {"batches": 0},
            }
        )
    )
    assert train_main([str(tmp_path / "r.yaml"), "--check", "--world-size", "2"]) == 0
    err = capsys.readouterr().err
    assert (
        f"vocabulary: tokenizer {len(tok_a):,} tokens, rows {len(tok_a) + 4:,} -> {len(tok_a) + 4:,} "
        f"(4 rows past the tokenizer) [keep]" in err
    )
    assert (
        train_main(
            [str(tmp_path / "r.yaml"), "--check", "--world-size", "2", "--set", f"tokenizer.source=bpe:{d / 'tok_b'}"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert f"rows {len(tok_a) + 4:,} -> {len(tok_b):,} (0 rows past the tokenizer) [swap]" in err
    counts = plan_vocab(recipe(tmp_path / "m", "b"), len(tok_a) + 4, tok_b, True, tok_a).counts()
    assert "vocabulary rows: {copied:,} copied, {composed:,} composed".format(**counts) in err


@pytest.mark.parametrize("tie", [False, True])
def test_swap_copies_shared_tokens_exactly_and_composes_new_ones(tmp_path, corpora, tie):
    d, tok_a, _, tok_b = corpora
    ref = save_model(tmp_path / "m", tok_a, tie=tie)
    plan, src = swap_source(tmp_path / "m", tok_a, tok_b)
    counts = plan.counts()
    assert plan.mode == "swap" and counts["copied"] > 250 and counts["composed"] > 20 and counts["mean"] == 2
    back = build_and_export(src, tmp_path / "out")
    old_b, _ = token_bytes(tok_a)
    new_b, new_special = token_bytes(tok_b)
    by_bytes = {b: i for i, b in reversed(list(enumerate(old_b)))}
    mats = [
        (back.get_input_embeddings().weight, ref.get_input_embeddings().weight),
        (back.get_output_embeddings().weight, ref.get_output_embeddings().weight),
    ]
    assert back.config.tie_word_embeddings == tie
    m = plan.row_map
    copied = composed = 0
    for i, b in enumerate(new_b):
        if b in by_bytes:  # a token both vocabularies have (special tokens by their text): its exact rows
            assert m.kind[i] == COPY
            for got, old in mats:
                assert torch.equal(got[i], old[by_bytes[b]]), (i, b)
            copied += 1
        elif m.kind[i] == COMPOSED:  # its text, split by the OLD tokenizer: the mean of those rows
            pieces = m.idx[m.ptr[i] : m.ptr[i + 1]].tolist()
            assert b"".join(old_b[p] for p in pieces) == b
            if b.decode("utf-8", "ignore").encode() == b:
                assert pieces == tok_a(b.decode(), add_special_tokens=False)["input_ids"]
            for got, old in mats:
                torch.testing.assert_close(got[i], old[pieces].mean(0), rtol=0, atol=1e-6)
            composed += 1
        else:  # the two special tokens tokenizer A does not have: the mean of all old rows
            assert i in new_special
            for got, old in mats:
                torch.testing.assert_close(got[i], old.mean(0), rtol=0, atol=1e-6)
    assert (copied, composed) == (counts["copied"], counts["composed"])


def lm_loss(model, tok, texts) -> float:
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    flat = torch.tensor([i for row in ids for i in row])
    n = len(flat) // 32
    batch = flat[: n * 32].view(n, 32)
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def without_composition(row_map: RowMap) -> RowMap:
    """The same map with every composed row replaced by the overall mean (what a plain resize gives)."""
    m = row_map
    sources = [[] if m.kind[i] == COMPOSED else m.idx[m.ptr[i] : m.ptr[i + 1]].tolist() for i in range(m.num_rows)]
    return RowMap.from_lists(sources, m.source_rows, [MEAN if k == COMPOSED else int(k) for k in m.kind])


def test_swap_keeps_what_a_trained_model_learned(tmp_path, corpora):
    """After a swap the loss on fresh text stays well below ln(V) and far below the same swap by id; composing
    new tokens from the old pieces beats starting them from the mean."""
    d, tok_a, tok_b, tok_c = corpora
    model = save_model(tmp_path / "init", tok_a)
    torch.manual_seed(0)
    ids = tok_a("\n".join((d / "a.txt").read_text().splitlines()), add_special_tokens=False)["input_ids"]
    data = torch.tensor(ids[: len(ids) // 32 * 32]).view(-1, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(120):  # ~3 s: loss from ln(300) = 5.7 to ~1.4
        batch = data[torch.randint(len(data), (16,))]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path / "m")
    tok_a.save_pretrained(tmp_path / "m")
    fresh = sentences(random.Random(random.random()), 200)  # text neither tokenizer nor model saw
    trained = lm_loss(model, tok_a, fresh)
    assert trained < math.log(len(tok_a)) - 3.0, trained

    def loss_after(tok, by_token=True, compose=True):
        plan, src = swap_source(tmp_path / "m", tok_a, tok, by_token)
        if not compose:
            src = CheckpointSource.from_dir(
                tmp_path / "m", vocab_size=plan.rows_after, row_map=without_composition(plan.row_map)
            )
        return lm_loss(build_and_export(src, tmp_path / "out"), tok, fresh)

    # B: as large as A, other data, other special tokens (ids shifted): most tokens are shared
    # (measured: 3.6 by token, 13.2 by id, ln V = 5.7)
    by_token, by_id = loss_after(tok_b), loss_after(tok_b, by_token=False)
    assert by_token < math.log(len(tok_b)) - 1.5, (by_token, math.log(len(tok_b)))
    assert by_token < by_id - 5.0, (by_token, by_id)
    # C: larger, most of the text in whole-word tokens A only has as pieces (measured: 8.5 composed, 12.9
    # from the mean, 14.6 by id; per token, and C's tokens are 3.4 of A's on this text)
    composed, mean_only, by_id = loss_after(tok_c), loss_after(tok_c, compose=False), loss_after(tok_c, by_token=False)
    assert composed < mean_only - 2.0, (composed, mean_only)
    assert composed < by_id - 3.0, (composed, by_id)


def test_a_hub_model_is_snapshotted_once_then_read_per_rank(tmp_path, monkeypatch, corpora):
    """A hub id becomes a local snapshot (config, safetensors, tokenizer), which ranks then read per tensor."""
    from vp_accelerate.train.recipe import presets
    from vp_accelerate.train.recipe.presets import local_model_dir

    d, tok_a, *_ = corpora
    save_model(tmp_path / "snap", tok_a)
    calls = []
    monkeypatch.setattr(
        presets,
        "snapshot_download",
        lambda repo, allow_patterns: calls.append((repo, allow_patterns)) or str(tmp_path / "snap"),
    )
    assert local_model_dir("org/model") == str(tmp_path / "snap")
    assert calls[0][0] == "org/model" and {"*.json", "*.safetensors"} <= set(calls[0][1])
    assert local_model_dir(str(tmp_path / "snap")) == str(tmp_path / "snap") and len(calls) == 1
    assert tokenizer_source(recipe("org/model")) == "org/model"  # the model's own tokenizer, by its hub id


def test_pretrained_weights_refuse_a_config_vocab_size_wherever_the_config_is_read(tmp_path, corpora):
    """`model.config.vocab_size` with pretrained weights is one error at --check, in the trainer and in the
    planner (`presets.with_overrides`); the trainer used to replace the value silently by the checkpoint's."""
    from vp_accelerate.train.cli.plan import resolve_auto
    from vp_accelerate.train.cli.preflight import _model_config
    from vp_accelerate.train.run.trainer import plan_model

    d, tok_a, *_ = corpora
    save_model(tmp_path / "m", tok_a)
    r = recipe(tmp_path / "m")
    r.model.config = {"vocab_size": len(tok_a) + 64}
    r.pipeline.schedule = "auto"
    for read in (
        lambda: _model_config(r),
        lambda: plan_model(r, tok_a, str(tmp_path / "m")),
        lambda: resolve_auto(r, 2),
    ):
        with pytest.raises(RecipeError, match="model.config.vocab_size: the rows of pretrained weights follow"):
            read()
    r.model.pretrained_weights = False  # a fresh model takes the override
    assert _model_config(r).vocab_size == len(tok_a) + 64


def test_preflight_and_trainer_read_one_model_config_and_model_tokenizer(tmp_path, corpora):
    """`presets.recipe_model_config` and `vocab_plan.model_tokenizer_of` are what preflight and the trainer both
    call: a mistyped `model.config` value is the same error in both (the trainer used to take it), and the model's
    own tokenizer is read only when the run starts from the model's weights."""
    from vp_accelerate.train.cli.preflight import _model_config
    from vp_accelerate.train.run.trainer import plan_model
    from vp_accelerate.train.tokens.vocab_plan import model_tokenizer_of

    d, tok_a, tok_b, _ = corpora
    save_model(tmp_path / "m", tok_a)
    for source in ("llama-tiny", str(tmp_path / "m")):
        r = recipe(source, "x")
        r.model.config = {"num_hidden_layers": "2"}
        errors = []
        for read in (
            lambda: _model_config(r),
            lambda: plan_model(r, tok_a, None if source == "llama-tiny" else source),
        ):
            with pytest.raises(RecipeError, match="model.config.num_hidden_layers: expects an integer") as err:
                read()
            errors.append(str(err.value))
        assert errors[0] == errors[1]
    r = recipe(tmp_path / "m", "other")
    assert model_tokenizer_of(r, tok_b, "other", lambda own: ("read", own)) == ("read", str(tmp_path / "m"))
    assert model_tokenizer_of(r, tok_a, str(tmp_path / "m"), None) is tok_a  # the run's tokenizer is the model's
    r.model.pretrained_weights = False
    assert model_tokenizer_of(r, tok_b, "other", lambda own: ("read", own)) is None
