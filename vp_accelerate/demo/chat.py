"""A small demo chat set made offline from text that ships in PyPI packages (Babel/CLDR, Faker, Python).

Each conversation is 1-3 question/answer turns (after an optional system turn) whose answers are facts
the data itself holds: what a country, a language or a month is called in another language (CLDR), how a
locale writes a date or an amount of money (Babel's formatters), the weekday of a date, a Faker name of a
locale, the first lines of a standard-library docstring. Deterministic for a seed and package versions;
written as `train.jsonl` / `eval.jsonl` with one `{"messages": [...]}` per line (`data.format: chat`).
Needs the `demo` extra: `pip install faker babel`.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import json
import os
import random

LOCALES = [
    "en",
    "de",
    "fr",
    "es",
    "it",
    "nl",
    "pl",
    "ru",
    "uk",
    "el",
    "tr",
    "ar",
    "he",
    "hi",
    "ja",
    "zh",
    "ko",
    "pt",
    "sv",
    "fi",
    "vi",
    "th",
    "id",
    "cs",
]
TERRITORIES = [
    "FR",
    "DE",
    "JP",
    "CN",
    "US",
    "GB",
    "RU",
    "BR",
    "IN",
    "EG",
    "IT",
    "ES",
    "GR",
    "TR",
    "KR",
    "MX",
    "CA",
    "AU",
    "AR",
    "SE",
    "NG",
    "KE",
    "VN",
    "TH",
    "PL",
    "UA",
    "NL",
    "PT",
    "IR",
    "IL",
]
FAKER_LOCALES = {
    "en": "en_US",
    "de": "de_DE",
    "fr": "fr_FR",
    "es": "es_ES",
    "it": "it_IT",
    "ru": "ru_RU",
    "ja": "ja_JP",
    "zh": "zh_CN",
    "pl": "pl_PL",
    "el": "el_GR",
    "ar": "ar_AA",
    "hi": "hi_IN",
}
PY_NAMES = [
    "json.dumps",
    "json.loads",
    "os.path.join",
    "math.gcd",
    "itertools.chain",
    "functools.partial",
    "collections.Counter",
    "re.sub",
    "shutil.copy2",
    "textwrap.dedent",
    "statistics.median",
    "random.shuffle",
    "bisect.insort",
    "heapq.heappush",
    "zlib.crc32",
    "base64.b64encode",
]
SYSTEM = "You answer short questions about languages, places, dates and Python."


def _question_makers(rng: random.Random):
    # optional dependencies (the demo extra)
    from babel import Locale, dates, numbers
    from faker import Faker

    en = Locale("en")
    locs = {code: Locale.parse(code) for code in LOCALES}
    fakers: dict[str, Faker] = {}

    def lang() -> tuple[str, object]:
        code = rng.choice(LOCALES)
        return en.languages[code], locs[code]

    def territory():
        name, loc = lang()
        code = rng.choice(TERRITORIES)
        return f"What is {en.territories[code]} called in {name}?", loc.territories[code]

    def own_language():
        name, loc = lang()
        return f"What do {name} speakers call their language?", loc.languages[loc.language]

    def month():
        name, loc = lang()
        m = rng.randrange(1, 13)
        return f"What is the name of month {m} in {name}?", loc.months["format"]["wide"][m]

    def some_day() -> datetime.date:
        return datetime.date(1950, 1, 1) + datetime.timedelta(days=rng.randrange(365 * 100))

    def weekday():
        day = some_day()
        return f"What day of the week was {day.isoformat()}?", f"{day.isoformat()} was a {day:%A}."

    def date():
        name, loc = lang()
        day = some_day()
        return (
            f"How do {name} speakers write the date {day.isoformat()}?",
            dates.format_date(day, format="long", locale=loc),
        )

    def money():
        name, loc = lang()
        amount = rng.randrange(100, 10_000_000) / 100
        currency = rng.choice(["EUR", "USD", "JPY", "INR", "GBP", "BRL"])
        return (
            f"Write {amount:.2f} {currency} the way {name} speakers do.",
            numbers.format_currency(amount, currency, locale=loc),
        )

    def person():
        code = rng.choice(sorted(FAKER_LOCALES))
        if code not in fakers:
            fakers[code] = Faker(FAKER_LOCALES[code])
            fakers[code].seed_instance(rng.randrange(2**31))
        return f"Give me a typical {en.languages[code]} name.", fakers[code].name()

    def python():
        name = rng.choice(PY_NAMES)
        module, _, attr = name.rpartition(".")
        doc = inspect.getdoc(getattr(importlib.import_module(module), attr)) or ""
        first = doc.split("\n\n")[0].replace("\n", " ")
        return f"What does Python's {name} do?", first[:300]

    return [territory, own_language, month, weekday, date, money, person, python]


def iter_conversations(n: int, seed: int = 0):
    """Yield `n` conversations (lists of {role, content}) in a deterministic order."""
    rng = random.Random(seed)
    makers = _question_makers(rng)
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            question, answer = rng.choice(makers)()
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        yield messages


def make_demo_chat(out_dir: str, conversations: int = 4000, seed: int = 0, eval_every: int = 20) -> dict:
    """Write `train.jsonl` and `eval.jsonl` (every `eval_every`-th conversation) to `out_dir`; return counts."""
    try:  # an availability probe: the import is the check
        import babel  # noqa: F401
        import faker  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the demo chat set needs the `demo` extra (pip install faker babel): {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    counts = {"train": 0, "eval": 0}
    paths = {s: os.path.join(out_dir, f"{s}.jsonl") for s in counts}
    files = {s: open(p + ".tmp", "w", encoding="utf-8") for s, p in paths.items()}
    try:
        for i, messages in enumerate(iter_conversations(conversations, seed)):
            split = "eval" if i % eval_every == eval_every - 1 else "train"
            files[split].write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            counts[split] += 1
    finally:
        for f in files.values():
            f.close()
    for split, path in paths.items():  # a half-written set is never mistaken for a finished one
        os.replace(path + ".tmp", path)
    return counts


def make_demo_preference(
    out_dir: str, conversations: int = 4000, seed: int = 0, eval_every: int = 20, unpaired: bool = False
) -> dict:
    """Write preference pairs (TRL's conversational shape: `prompt` turns, `chosen` / `rejected` assistant turns)
    as `train.jsonl` and `eval.jsonl` to `out_dir`: the chosen answer is the conversation's own last answer, the
    rejected one the last answer of another conversation (a seeded derangement), so the pairs are made offline.
    `unpaired`: KTO's rows instead (`prompt`, `completion`, `label`): one per conversation, its own answer
    (label true) for every other conversation and the other conversation's (label false) for the rest — one row
    per prompt, so a microbatch's KL rows (a prompt with another row's completion) are all mismatched."""
    convs = list(iter_conversations(conversations, seed))
    order = random.Random(seed).sample(range(len(convs)), len(convs))
    other = {order[i]: order[(i + 1) % len(order)] for i in range(len(order))}  # never itself (n > 1)
    os.makedirs(out_dir, exist_ok=True)
    counts = {"train": 0, "eval": 0}
    paths = {s: os.path.join(out_dir, f"{s}.jsonl") for s in counts}
    files = {s: open(p + ".tmp", "w", encoding="utf-8") for s, p in paths.items()}
    try:
        for i, messages in enumerate(convs):
            last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
            rejected = [m for m in convs[other[i]] if m["role"] == "assistant"][-1]
            row = {"prompt": messages[:last], "chosen": [messages[last]], "rejected": [rejected]}
            if unpaired:
                good = i % 2 == 0
                row = {"prompt": messages[:last], "completion": [messages[last] if good else rejected], "label": good}
            split = "eval" if i % eval_every == eval_every - 1 else "train"
            files[split].write(json.dumps(row, ensure_ascii=False) + "\n")
            counts[split] += 1
    finally:
        for f in files.values():
            f.close()
    for split, path in paths.items():
        os.replace(path + ".tmp", path)
    return counts
