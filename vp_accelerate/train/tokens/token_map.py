"""A meaning-preserving tokenizer swap: which old embedding rows each token of the new tokenizer starts from.

Tokens are compared as the byte strings they stand for, not as ids: a byte-level BPE token `Ġthe`
(GPT-2 / Llama-3 / Qwen alphabet) and a SentencePiece token `▁the` both stand for b" the", and a
byte-fallback token `<0xE4>` for b"\\xe4". So:

- a new token whose bytes are an old token's bytes starts from that old row (copied exactly);
- special tokens match by their text (`<|endoftext|>`), else by role (EOS, BOS, PAD, UNK);
- any other new token starts from the mean of the old rows of the pieces the OLD tokenizer splits its
  text into (checked to reproduce its bytes; a token that is not whole UTF-8, e.g. half of a
  character, is split greedily into the longest old tokens instead);
- what cannot be composed (a special token without a match, rows past the tokenizer) starts from the
  mean of all old rows.

The same map is applied to the embedding and the lm_head (or the tied matrix) by `models.RowMap`.
"""

from __future__ import annotations

import json
from functools import lru_cache

from vp_accelerate.models.row_map import COMPOSED, COPY, MEAN, RowMap


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _component_types(node) -> set[str]:
    """Every `type` inside a tokenizer.json component (decoders and pre-tokenizers nest in Sequences)."""
    if isinstance(node, dict):
        out = {node["type"]} if isinstance(node.get("type"), str) else set()
        for value in node.values():
            out |= _component_types(value)
        return out
    if isinstance(node, list):
        return set().union(*(_component_types(v) for v in node)) if node else set()
    return set()


def token_bytes(tokenizer) -> tuple[list[bytes | None], set[int]]:
    """(bytes each id stands for, ids of special tokens). Special tokens' entries are their text's bytes."""
    n = len(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    kinds, decoder_text = set(), ""
    for part in ("decoder", "pre_tokenizer"):  # their JSON, not the whole tokenizer's (the vocabulary is big)
        component = getattr(backend, part, None)
        if component is not None:
            text = component.__getstate__()
            text = text.decode() if isinstance(text, bytes) else text
            kinds |= _component_types(json.loads(text))
            decoder_text += text if part == "decoder" else ""
    byte_level = "ByteLevel" in kinds
    metaspace = bool(kinds & {"Metaspace", "Replace"}) or "▁" in decoder_text
    byte_fallback = "ByteFallback" in kinds or bool(getattr(getattr(backend, "model", None), "byte_fallback", False))
    dec = _byte_decoder()
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    special = {i for i, t in added.items() if getattr(t, "special", False)}
    special |= {i for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None and 0 <= i < n}
    pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
    out: list[bytes | None] = []
    for i, tok in enumerate(pieces):
        if tok is None:
            out.append(None)
        elif i in added:  # added tokens are literal text, not in the model's alphabet
            out.append(str(added[i].content if hasattr(added[i], "content") else added[i]).encode("utf-8"))
        elif byte_level and all(c in dec for c in tok):
            out.append(bytes(dec[c] for c in tok))
        elif byte_fallback and len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            out.append(bytes([int(tok[3:5], 16)]))
        elif metaspace:
            out.append(tok.replace("▁", " ").encode("utf-8"))
        else:
            out.append(tok.encode("utf-8"))
    return out, special


_ROLES = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id")


def _greedy_pieces(data: bytes, table: dict[bytes, int], longest: int) -> list[int] | None:
    """Longest-match split of `data` into old tokens' byte strings; None when some byte has no token."""
    out, i = [], 0
    while i < len(data):
        for j in range(min(len(data), i + longest), i, -1):
            tid = table.get(data[i:j])
            if tid is not None:
                out.append(tid)
                i = j
                break
        else:
            return None
    return out


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of many texts without special tokens (the fast backend directly: no per-text Python objects)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [e.ids for e in encode(texts, add_special_tokens=False)]


def build_row_map(old_tok, new_tok, num_rows: int, source_rows: int) -> RowMap:
    """The RowMap from a model's rows (tokenized by `old_tok`, `source_rows` rows) to `new_tok`'s ids.

    `num_rows` >= len(new_tok): the new matrix's rows (the extra padding rows start from the mean).
    """
    if num_rows < len(new_tok):
        raise ValueError(f"{num_rows} rows cannot hold the new tokenizer's {len(new_tok)} tokens")
    old_bytes, old_special = token_bytes(old_tok)
    new_bytes, new_special = token_bytes(new_tok)
    table: dict[bytes, int] = {}
    specials_by_text: dict[bytes, int] = {}
    for i, b in enumerate(old_bytes[:source_rows]):
        if b is None:
            continue
        target = specials_by_text if i in old_special else table
        target.setdefault(b, i)  # the lowest id wins when two tokens stand for the same bytes
    roles = {}
    for attr in _ROLES:
        old_id, new_id = getattr(old_tok, attr, None), getattr(new_tok, attr, None)
        if old_id is not None and new_id is not None and old_id < source_rows:
            roles.setdefault(new_id, old_id)
    longest = max((len(b) for b in table), default=1)

    sources: list[list[int]] = [[] for _ in range(num_rows)]
    kinds = [MEAN] * num_rows
    to_compose: list[int] = []
    for i, b in enumerate(new_bytes):
        if b is None:
            continue
        if i in new_special:
            old = specials_by_text.get(b, roles.get(i))
            if old is not None:
                sources[i], kinds[i] = [old], COPY
        elif b in table:
            sources[i], kinds[i] = [table[b]], COPY
        elif b:
            to_compose.append(i)
    texts, text_ids = [], []
    for i in to_compose:
        try:
            texts.append(new_bytes[i].decode("utf-8"))
            text_ids.append(i)
        except UnicodeDecodeError:
            pass
    split = dict(zip(text_ids, _encode_many(old_tok, texts))) if texts else {}
    for i in to_compose:
        pieces = split.get(i)
        # the old tokenizer's split, if it spells exactly this token's bytes (normalizers may change text)
        if (
            pieces is None
            or any(p >= source_rows or old_bytes[p] is None for p in pieces)
            or b"".join(old_bytes[p] for p in pieces) != new_bytes[i]
        ):
            pieces = _greedy_pieces(new_bytes[i], table, longest)
        if pieces:
            sources[i], kinds[i] = list(pieces), COMPOSED if len(pieces) > 1 else COPY
    return RowMap.from_lists(sources, source_rows, kinds)


def same_vocabulary(a, b) -> bool:
    """True when two tokenizers give every token string the same id (a swap would change nothing)."""
    return len(a) == len(b) and a.get_vocab() == b.get_vocab()
