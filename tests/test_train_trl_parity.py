"""Rows tokenized as TRL 1.16 tokenizes them, checked against TRL's own code (DPOTrainer._prepare_dataset and its
DataCollatorForPreference, SFTTrainer._prepare_dataset, called on a stand-in trainer that carries only the
tokenizer), with a Llama-style tokenizer whose post-processor adds `<s>`: the BOS where the tokenizer's settings
put one (strings) or the chat template writes one (turns), the prompt / completion boundary where TRL puts it
("Answer: " + "1. hello": the space goes with the completion's first token), rows longer than data.seq_len cut
keep_start, pairs whose prompt fills it dropped and counted. (The earlier code tokenized without special
tokens and the prompt apart, and dropped long pairs: each comparison here failed on it.)"""

import json
import types

import numpy as np
import pytest
import torch

from vp_accelerate.train.data import chat_rows, formats, prepare_data
from vp_accelerate.train.data.preference import encode_pair
from vp_accelerate.train.data.tokenize import RowTokenizer
from vp_accelerate.train.recipe import DataSection

trl = pytest.importorskip("trl")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
"""A Llama-2-like template: the BOS written by the template, so apply_chat_template adds none of its own."""

PROMPTS = ["Answer: ", "Answer:", "The capital of france is", "hello world "]
COMPLETIONS = ["1. hello", " paris", "2. world", "gamma delta"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE whose post-processor adds `<s>` (as Llama's and Mistral's base tokenizers), saved and
    loaded back as the trainer loads one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    lines = [p + c for p in PROMPTS for c in COMPLETIONS] + ["[user] [assistant] capital france paris gamma"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(lines * 10, trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("bos_tok")
    fast.save_pretrained(folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    assert loaded("hello")["input_ids"][0] == loaded.bos_token_id  # the tokenizer adds <s> by its own settings
    return loaded


def _dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


def _trl_dpo(tok, rows):
    """TRL's DPOTrainer tokenization of `rows`: [(prompt_ids, chosen_ids, rejected_ids)]."""
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir="unused", report_to=[], bf16=False, use_cpu=True, dataset_num_proc=None)
    out = DPOTrainer._prepare_dataset(types.SimpleNamespace(_tokenizer=tok), _dataset(rows), tok, args, "train")
    return [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in out]


def _trl_sft(tok, rows):
    """TRL's SFTTrainer tokenization of `rows` (completion-only loss, its default): [(input_ids, labels)]."""
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir="unused", report_to=[], bf16=False, use_cpu=True, dataset_num_proc=None, max_length=None
    )
    stand_in = types.SimpleNamespace(_tokenizer=tok, completion_only_loss=True, chat_template=None)
    out = SFTTrainer._prepare_dataset(stand_in, _dataset(rows), tok, args, False, None, "train")
    return [(r["input_ids"], r["labels"]) for r in out]


def _ours_pair(tok, row):
    template = formats.chat_template_of(tok)[0]
    return encode_pair(tok, template, chat_rows.template_keys(template), row, DataSection(format="preference"))


def _as_trl(prompt_ids, chosen_ids, rejected_ids):
    c, r = prompt_ids + chosen_ids, prompt_ids + rejected_ids
    return c, [0] * len(prompt_ids) + [1] * len(chosen_ids), r, [0] * len(prompt_ids) + [1] * len(rejected_ids)


def test_standard_pairs_match_dpo_trainer_with_bos_and_the_boundary(tok):
    rows = [
        {"prompt": p, "chosen": c, "rejected": COMPLETIONS[(k + 1) % 4]}
        for k, c in enumerate(COMPLETIONS)
        for p in PROMPTS
    ]
    for row, want in zip(rows, _trl_dpo(tok, rows)):
        got = _ours_pair(tok, row)
        assert got == _as_trl(*want), row
        assert got[0][0] == tok.bos_token_id and got[0][-1] == tok.eos_token_id
    # "Answer: " + "1. hello": the prompt's space is the completion's first token's, and that token carries loss
    c_ids, c_mask, _, _ = _ours_pair(tok, {"prompt": "Answer: ", "chosen": "1. hello", "rejected": "2. world"})
    first = c_mask.index(1)
    assert tok.decode(c_ids[first : first + 1]).startswith(" "), tok.convert_ids_to_tokens(c_ids)


def test_conversational_and_implicit_prompt_pairs_match_dpo_trainer(tok):
    prompt = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "capital france"},
    ]
    chosen, rejected = [{"role": "assistant", "content": "paris"}], [{"role": "assistant", "content": "gamma delta"}]
    explicit = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    implicit = {"chosen": prompt + chosen, "rejected": prompt + rejected}
    (want,) = _trl_dpo(tok, [explicit])
    assert _ours_pair(tok, explicit) == _as_trl(*want)
    (want_implicit,) = _trl_dpo(tok, [implicit])
    assert _ours_pair(tok, implicit) == _as_trl(*want_implicit) == _as_trl(*want)
    assert want[0][0] == tok.bos_token_id and want[0][1] != tok.bos_token_id  # the template's BOS, once


def _row_tokenizer(tok, fmt):
    cfg = DataSection(format=fmt)
    return RowTokenizer(tok, cfg, len(tok), "rows", 0, fmt)


def test_sft_text_prompt_completion_and_chat_match_sft_trainer(tok):
    texts = [{"text": p + c} for p in PROMPTS for c in COMPLETIONS]
    for row, (ids, _) in zip(texts, _trl_sft(tok, texts)):
        _, got, mask, _ = _row_tokenizer(tok, "text").encode(row)
        assert got == ids and mask is None and got[0] == tok.bos_token_id, row
    pcs = [{"prompt": p, "completion": c} for p in PROMPTS for c in COMPLETIONS]
    for row, (ids, labels) in zip(pcs, _trl_sft(tok, pcs)):
        _, got, mask, _ = _row_tokenizer(tok, "prompt_completion").encode(row)
        assert got == ids and formats.labels_from_mask(np.array(got), np.array(mask)).tolist() == labels, row
    from vp_accelerate.train.run.samples import prompt_ids

    assert prompt_ids(tok, "Answer:", "text") == tok("Answer:")["input_ids"]  # eval.prompts start as rows do: BOS
    chats = [
        {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
        for p in PROMPTS
        for c in COMPLETIONS
    ]
    for row, (ids, _) in zip(chats, _trl_sft(tok, chats)):  # TRL trains every token here; the ids are the same
        _, got, mask, _ = _row_tokenizer(tok, "chat").encode(row)
        assert got == ids and got.count(tok.bos_token_id) == 1, row


def test_long_pairs_are_cut_keep_start_as_the_collator_and_prompt_filling_ones_counted(tok, tmp_path):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    rows = [
        {"prompt": p, "chosen": c + " world gamma" * (3 * k), "rejected": "2. world"}
        for k, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS))
    ]
    rows.append({"prompt": "hello world " * 8, "chosen": " paris", "rejected": " gamma"})  # the prompt fills seq_len
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    seq_len = 12
    data = prepare_data(
        DataSection(files=[str(path)], format="preference", seq_len=seq_len, eval_holdout=0), tok, len(tok)
    )
    stats = data.stats["train"]
    assert len(data.train) == len(rows) - 1 and stats.dropped == 1 and stats.truncated >= 2, stats
    kept = [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in _trl_dpo(tok, rows[:-1])]
    want = DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=seq_len)(kept)
    n = len(kept)
    for k in range(n):
        for row, trl_row in (
            (2 * k, k),
            (2 * k + 1, n + k),
        ):  # ours interleave pairs, TRL's batch is [chosen, rejected]
            length = int(want["attention_mask"][trl_row].sum())
            assert data.train.ids[row, :length].tolist() == want["input_ids"][trl_row, :length].tolist()
            labels = np.where(
                want["completion_mask"][trl_row, 1:length] == 1, want["input_ids"][trl_row, 1:length], -100
            )
            assert data.train.labels[row, 1:length].tolist() == labels.tolist()


def test_empty_chosen_names_its_field_and_identical_pairs_are_warned_with_their_line(tok, tmp_path, monkeypatch):
    with pytest.raises(formats.FormatError, match="'chosen' is empty"):
        _ours_pair(tok, {"prompt": "Answer: ", "chosen": "", "rejected": "2. world"})
    rows = [{"prompt": p, "chosen": c, "rejected": "delta hello"} for p in PROMPTS for c in COMPLETIONS]
    rows[5]["rejected"] = rows[5]["chosen"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # the data warnings' own logger, heard directly: another module's test in this worker may have changed the
    # root logger's handlers or this logger's level, and only rank 0 warns
    import logging

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("vp_accelerate.train")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(logger, "disabled", False)
    level = logger.level
    logger.setLevel(logging.WARNING)  # the coverage walk's test quiets the parent "vp_accelerate" in its worker
    logger.addHandler(handler)
    try:
        data = prepare_data(
            DataSection(files=[str(path)], format="preference", seq_len=32, eval_holdout=0), tok, len(tok)
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert data.stats["train"].same == 1 and data.stats["train"].same_examples == [f"{path}, line 6"]
    text = "\n".join(said)
    assert "chosen == rejected" in text and "line 6" in text


def _trl_cpo(tok, rows, trainer="cpo"):
    """TRL's CPOTrainer (or ORPOTrainer) tokenization of `rows`, conversational ones rendered first as its
    __init__ does: [(chosen ids, chosen mask, rejected ids, rejected mask)]."""
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt

    if trainer == "cpo":
        from trl.experimental.cpo.cpo_trainer import CPOTrainer as Trainer
    else:
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer as Trainer
    stand_in = types.SimpleNamespace(processing_class=tok, is_encoder_decoder=False, max_length=512)
    stand_in.build_tokenized_answer = types.MethodType(Trainer.build_tokenized_answer, stand_in)
    out = []
    for row in rows:
        row = maybe_apply_chat_template(maybe_extract_prompt(row), tok)
        b = Trainer.tokenize_row(stand_in, row)
        out.append(
            tuple(
                part
                for side in ("chosen_", "rejected_")
                for part in (b[f"{side}input_ids"], [int(x != -100) for x in b[f"{side}labels"]])
            )
        )
    return out


def _ours_cpo(tok, row):
    template = formats.chat_template_of(tok)[0]
    keys = chat_rows.template_keys(template)
    return encode_pair(tok, template, keys, row, DataSection(format="preference"), style="cpo")


@pytest.mark.parametrize("trainer", ["cpo", "orpo"])
def test_simpo_and_orpo_pairs_match_cpo_and_orpo_trainers_each_rows_boundary(tok, trainer):
    """SimPO / ORPO rows as CPOTrainer / ORPOTrainer tokenize them: no special tokens, then the BOS id, the
    EOS id after each completion, and each row's own boundary (a prompt's trailing space merged into one row's
    first token and not the other's: DPOTrainer's split takes the shorter prompt for both)."""
    completions = COMPLETIONS + [" paris", "\nparis", "  gamma"]
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p in PROMPTS for c in completions for r in completions[:3]]
    differs = 0
    for row, want in zip(rows, _trl_cpo(tok, rows, trainer)):
        got = _ours_cpo(tok, row)
        assert got == want, (row, got, want)
        differs += got != _ours_pair(tok, row)
        assert got[0][0] == tok.bos_token_id and got[0][-1] == tok.eos_token_id
    assert differs  # the DPO split differs somewhere on these rows: the test sees the boundary
    prompt = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "world"},
        {"role": "user", "content": "capital france"},
    ]
    chosen, rejected = [{"role": "assistant", "content": "paris"}], [{"role": "assistant", "content": "gamma delta"}]
    for row in (
        {"prompt": prompt, "chosen": chosen, "rejected": rejected},
        {"chosen": prompt + chosen, "rejected": prompt + rejected},
    ):
        (want,) = _trl_cpo(tok, [row], trainer)
        assert _ours_cpo(tok, row) == want, row


CHATML_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML whose assistant turns are `{% generation %}` blocks: the `<|im_end|>` inside, its `\\n` outside."""


@pytest.fixture(scope="module")
def chatml_tok(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    lines = [p + c for p in PROMPTS for c in COMPLETIONS] + ["system user assistant\n"]
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(lines * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHATML_GENERATION
    folder = tmp_path_factory.mktemp("chatml_tok")
    fast.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_a_template_with_generation_blocks_masks_as_sft_trainers_assistant_only_loss(chatml_tok):
    """The template's own assistant mask is the loss mask, as SFTTrainer's assistant_only_loss: the `\\n` after
    each assistant `<|im_end|>` carries no loss (the turn-by-turn rendering gave it one)."""
    from trl import SFTConfig, SFTTrainer

    tok = chatml_tok
    chats = [
        {
            "messages": [
                {"role": "system", "content": "gamma"},
                {"role": "user", "content": p},
                {"role": "assistant", "content": c},
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": COMPLETIONS[(k + 1) % 4]},
            ]
        }
        for p in PROMPTS
        for k, c in enumerate(COMPLETIONS)
    ]
    args = SFTConfig(
        output_dir="unused",
        report_to=[],
        bf16=False,
        use_cpu=True,
        dataset_num_proc=None,
        max_length=None,
        assistant_only_loss=True,
    )
    stand_in = types.SimpleNamespace(_tokenizer=tok, completion_only_loss=True, chat_template=None)
    want = SFTTrainer._prepare_dataset(stand_in, _dataset(chats), tok, args, False, None, "train")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for row, trl_row in zip(chats, want):
        _, ids, mask, _ = _row_tokenizer(tok, "chat").encode(row)
        trl_mask = [int(x != -100) for x in trl_row["labels"]]  # its labels: -100 off the assistant mask
        assert ids == trl_row["input_ids"] and mask == trl_mask, (row, mask, trl_mask)
        ends = [i for i in range(len(ids) - 1) if ids[i] == end and mask[i]]  # the assistant turns' ends
        assert len(ends) == 2 and all(tok.decode(ids[i + 1]).startswith("\n") and not mask[i + 1] for i in ends)


def test_orpo_rows_label_the_chosen_prompt_and_say_where_completions_start(tok, tmp_path):
    """ORPO's data: ORPOTrainer's tokens, the chosen rows labelled on the prompt too (its NLL reads input_ids
    where attention_mask), the rejected on the completion, and `completion_start` where tokenize_row's labels
    start; the trainer hands it to the runtime's Preference."""
    from vp_accelerate.runtime.preference_config import PreferenceConfig
    from vp_accelerate.train.run.loop import preference_of

    rows = [
        {"prompt": p, "chosen": c, "rejected": COMPLETIONS[(k + 1) % 4]}
        for k, c in enumerate(COMPLETIONS)
        for p in PROMPTS
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = prepare_data(
        DataSection(files=[str(path)], format="preference", seq_len=24, eval_holdout=0), tok, len(tok), style="orpo"
    )
    want = _trl_cpo(tok, rows, "orpo")
    batch = data.train.batch(np.arange(len(rows)))
    for k, (c_ids, c_mask, r_ids, r_mask) in enumerate(want):
        for row, ids, mask in ((2 * k, c_ids, c_mask), (2 * k + 1, r_ids, r_mask)):
            n = len(ids)
            assert data.train.ids[row, :n].tolist() == ids
            assert int(batch["completion_start"][row]) == mask.index(1)
            labelled = [1] * n if row % 2 == 0 else mask
            assert (data.train.labels[row, :n] != -100).astype(int).tolist() == labelled
    section = PreferenceConfig(loss_type=["sft", "orpo"])
    batch["ref_logps"] = None
    assert torch.equal(preference_of(section, batch).completion_start, batch["completion_start"])


def test_conversational_orpo_pairs_on_chatml_match_orpo_trainer(chatml_tok):
    """ChatML turns for ORPO: the rendered text tokenized without special tokens, then ORPOTrainer's EOS id after
    the template's closing newline (its `<|im_end|>` is the EOS, but the row ends in the newline)."""
    tok = chatml_tok
    rows = [
        {
            "prompt": [{"role": "system", "content": "gamma"}, {"role": "user", "content": p}],
            "chosen": [{"role": "assistant", "content": c}],
            "rejected": [{"role": "assistant", "content": COMPLETIONS[(k + 2) % 4]}],
        }
        for p in PROMPTS
        for k, c in enumerate(COMPLETIONS)
    ]
    for row, want in zip(rows, _trl_cpo(tok, rows, "orpo")):
        got = _ours_cpo(tok, row)
        assert got == want, (row, got, want)
        assert got[0][-1] == tok.eos_token_id and got[0][-2] != tok.eos_token_id
