"""Token ids of a long text in bounded memory: a fast tokenizer keeps ~150-200 bytes per character of one call's
input (offsets, words, the encoding's arrays), so one 10 MB row costs 1.5-2 GB. A text longer than `PIECE_CHARS`
is encoded in pieces instead, each cut where the pieces' tokens are the whole text's.

A cut at position i is taken only once it is verified: the `VERIFY_CHARS` characters on either side, encoded
together, give exactly the tokens of the two sides encoded apart. Tokenizers work locally (a pre-tokenizer splits
at spaces and punctuation, and BPE merges inside those words), so a verified cut leaves the ids as one call would
give them. Cuts before a space or a line break are tried first (they are word boundaries for every byte-level
BPE), then any character; a tokenizer for which no tried cut verifies (one that marks the start of every input,
like SentencePiece's prefix space) encodes the rest of the text in one call, as it would have anyway.
"""

from __future__ import annotations

PIECE_CHARS = 200_000
"""Texts up to this many characters are encoded in one call (~40 MB of the tokenizer's working memory)."""

VERIFY_CHARS = 256
"""Characters on each side of a cut that are encoded both ways to verify it."""

CANDIDATES = 64
"""Cut positions tried near each piece's end before the rest is encoded whole."""


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _verified(tokenizer, text: str, i: int) -> bool:
    left, right = text[max(0, i - VERIFY_CHARS) : i], text[i : i + VERIFY_CHARS]
    return _ids(tokenizer, left + right) == _ids(tokenizer, left) + _ids(tokenizer, right)


def _candidates(text: str, start: int, end: int):
    """Cut positions near `end`, word boundaries first (a space or line break after a non-space), then any."""
    low = start + PIECE_CHARS // 2
    spaces = (i for i in range(end, low, -1) if text[i].isspace() and not text[i - 1].isspace())
    n = 0
    for i in spaces:
        yield i
        n += 1
        if n == CANDIDATES // 2:
            break
    yield from range(end, max(low, end - CANDIDATES // 2), -1)


def _cut(tokenizer, text: str, start: int) -> int:
    """Where the piece starting at `start` ends: a verified cut near start + PIECE_CHARS, or the text's end."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    for i in _candidates(text, start, end):
        if _verified(tokenizer, text, i):
            return i
    return len(text)


def _special_ends(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's own settings put before and after a text (a BOS, an EOS): one short text encoded
    with and without them."""
    plain = _ids(tokenizer, "a")
    full = list(tokenizer("a")["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def encode_text(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """The ids `tokenizer(text, add_special_tokens=...)` gives, encoded piece by piece when the text is long (the
    special tokens the tokenizer adds go around the whole text, once)."""
    if len(text) <= PIECE_CHARS:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = _cut(tokenizer, text, start)
        ids += _ids(tokenizer, text[start:end])
        start = end
    if add_special_tokens:
        before, after = _special_ends(tokenizer)
        ids = before + ids + after
    return ids
