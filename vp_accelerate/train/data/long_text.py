"""Token ids of a long text in bounded memory: a fast tokenizer keeps ~150-200 bytes per character of one call's
input (offsets, words, the encoding's arrays), so one 10 MB row costs 1.5-2 GB. A text longer than `PIECE_CHARS`
is encoded in pieces instead, each cut where the pieces' tokens are the whole text's.

A cut at position i is taken only once it is verified: the `VERIFY_CHARS` characters before it (L) encoded alone
give exactly the first tokens of L and the `VERIFY_CHARS` after it (R) encoded together, so no token spans the cut
and what follows does not change the tokens before it. Each piece after the first is then encoded behind its L
(the context) and the context's tokens are dropped: the piece's tokens are those it has in the middle of the text,
even for a tokenizer that marks the start of every input (SentencePiece's prefix space, a Llama-style
`Prepend("▁")` normalizer), which a piece encoded alone would get wrong. Tokenizers work locally (a pre-tokenizer
splits at spaces and punctuation, BPE merges inside those words, a Unigram lattice is cut at its spaces), so a
verified cut leaves the ids as one call would give them. Cuts at a space or a line break are tried first (before
and after it: word boundaries for byte-level BPE and for SentencePiece), then any character.

A text no tried cut splits is encoded whole up to `MAX_ONE_CALL_CHARS`; a longer one is `Unsplittable` (the
caller's invalid row), so no row grows the process by gigabytes. Formats that hand the tokenizer a whole field
(chat, prompt / completion, preference pairs) are held to the same bound per row (`formats.check_size`).
"""

from __future__ import annotations

PIECE_CHARS = 200_000
"""Texts up to this many characters are encoded in one call (~40 MB of the tokenizer's working memory)."""

VERIFY_CHARS = 256
"""Characters on each side of a cut that are encoded both ways to verify it (and the context a piece is encoded
behind)."""

CANDIDATES = 64
"""Cut positions tried near each piece's end before the rest is encoded whole."""

MAX_ONE_CALL_CHARS = 1_000_000
"""The most characters one tokenizer call may be handed: ~150-350 MB of its working memory (a chat row's offsets
cost the most per character). A longer text that no verified cut splits, or a longer row of a format tokenized
whole, is an invalid row."""


class Unsplittable(ValueError):
    """A text longer than MAX_ONE_CALL_CHARS that no verified cut splits."""


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _verified(tokenizer, text: str, i: int) -> bool:
    left, right = text[max(0, i - VERIFY_CHARS) : i], text[i : i + VERIFY_CHARS]
    alone = list(_ids(tokenizer, left))
    return list(_ids(tokenizer, left + right))[: len(alone)] == alone


def _candidates(text: str, start: int, end: int):
    """Cut positions near `end`, word boundaries first (before a space or line break that follows a non-space, then
    after one: the start of a word), then any."""
    low = start + PIECE_CHARS // 2
    n = 0
    for i in range(end, low, -1):
        if (text[i].isspace() and not text[i - 1].isspace()) or (text[i - 1].isspace() and not text[i].isspace()):
            yield i
            n += 1
            if n == CANDIDATES // 2:
                break
    yield from range(end, max(low, end - CANDIDATES // 2), -1)


def _cut(tokenizer, text: str, start: int) -> int:
    """Where the piece starting at `start` ends: a verified cut near start + PIECE_CHARS (less the context a later
    piece is encoded behind: no call is longer than PIECE_CHARS), or the text's end."""
    end = start + PIECE_CHARS - (VERIFY_CHARS if start else 0)
    if end >= len(text):
        return len(text)
    for i in _candidates(text, start, end):
        if _verified(tokenizer, text, i):
            return i
    return len(text)


def _piece(tokenizer, text: str, start: int, end: int) -> list[int]:
    """The tokens of text[start:end] as they are in the whole text: encoded behind the context before `start`,
    whose own tokens are dropped (a verified cut: they are the first tokens of the two encoded together)."""
    if start == 0:
        return list(_ids(tokenizer, text[:end]))
    context = text[max(0, start - VERIFY_CHARS) : start]
    before = list(_ids(tokenizer, context))
    ids = list(_ids(tokenizer, context + text[start:end]))
    if ids[: len(before)] != before:  # the piece changed the context's tokens: the cut held for R only
        raise Unsplittable(
            f"the tokenizer's tokens at character {start:,} depend on more than {VERIFY_CHARS} characters"
        )
    return ids[len(before) :]


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
    special tokens the tokenizer adds go around the whole text, once). Unsplittable when a text longer than
    MAX_ONE_CALL_CHARS has no verified cut."""
    if len(text) <= PIECE_CHARS:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
    ids: list[int] = []
    start = 0
    while start < len(text):
        end = _cut(tokenizer, text, start)
        if end - start > MAX_ONE_CALL_CHARS:
            raise Unsplittable(
                f"no cut near character {start + PIECE_CHARS:,} leaves the tokens as the whole text's, and the "
                f"{end - start:,} characters from {start:,} are more than one tokenizer call may take "
                f"({MAX_ONE_CALL_CHARS:,})"
            )
        ids += _piece(tokenizer, text, start, end)
        start = end
    if add_special_tokens:
        before, after = _special_ends(tokenizer)
        ids = before + ids + after
    return ids
