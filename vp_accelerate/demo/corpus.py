"""A multilingual demo corpus made offline from text that ships in PyPI packages.

Sources (all real text/vocabulary, nothing downloaded at run time):
- Faker's locale providers: each locale's lorem word list is drawn from real text in that language
  (Japanese, Chinese, Russian, Arabic, Hebrew, Greek, Thai, Bengali, Persian, ...), plus the
  locale's names, addresses and job titles.
- Babel's CLDR data: every locale's names of languages, territories, months and days, and dates
  and numbers formatted the way that locale writes them.
- Python's own docstrings (English prose from the standard library).

The output is deterministic for a given seed and package versions (recorded in manifest.json):
`train.jsonl` and `eval.jsonl` with one `{"text", "lang", "source"}` object per line.
Needs the `demo` extra: `pip install faker babel`.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import inspect
import json
import os
import random
import sys
from importlib.metadata import PackageNotFoundError, version

# Faker locales whose lorem provider is real text in that language (others fall back to Latin).
FAKER_LOCALES = [
    "en_US",
    "de_DE",
    "fr_FR",
    "es_ES",
    "it_IT",
    "nl_NL",
    "pl_PL",
    "cs_CZ",
    "da_DK",
    "ru_RU",
    "uk_UA",
    "el_GR",
    "he_IL",
    "ar_AA",
    "fa_IR",
    "hy_AM",
    "az_AZ",
    "bn_BD",
    "th_TH",
    "vi_VN",
    "ja_JP",
    "zh_CN",
    "zh_TW",
    "tl_PH",
    "la",
]

BABEL_LOCALES = [
    "en",
    "de",
    "fr",
    "es",
    "it",
    "nl",
    "pl",
    "cs",
    "da",
    "sv",
    "fi",
    "pt",
    "ro",
    "hu",
    "tr",
    "ru",
    "uk",
    "el",
    "he",
    "ar",
    "fa",
    "hy",
    "az",
    "hi",
    "bn",
    "ta",
    "th",
    "vi",
    "id",
    "ja",
    "zh",
    "ko",
    "sw",
    "am",
    "ka",
]

STDLIB_MODULES = [
    "abc",
    "argparse",
    "array",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http.client",
    "inspect",
    "io",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "math",
    "operator",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shlex",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "time",
    "timeit",
    "tokenize",
    "unittest",
    "urllib.parse",
    "uuid",
    "warnings",
    "weakref",
    "xml.etree.ElementTree",
    "zipfile",
    "zlib",
]


def _faker_docs(locale: str, seed: int, n: int):
    from faker import Faker  # optional dependency (the demo extra)

    fake = Faker(locale)
    fake.seed_instance(seed)
    for _ in range(n):
        parts = [fake.sentence(nb_words=6)]
        parts += [fake.paragraph(nb_sentences=fake.random_int(3, 8)) for _ in range(fake.random_int(2, 5))]
        if locale != "la":
            parts.append(f"{fake.name()}\n{fake.address()}")
        yield "\n\n".join(parts)


def _babel_docs(locale_name: str, seed: int):
    from babel import Locale, dates, numbers  # optional dependency (the demo extra)

    loc = Locale.parse(locale_name)
    rng = random.Random(f"{seed}-{locale_name}")
    langs = sorted(loc.languages.items())
    terrs = sorted(loc.territories.items())
    # Names of languages and territories in this locale's own words, in shuffled groups of lines.
    for table in (langs, terrs):
        items = [name for _, name in table]
        rng.shuffle(items)
        for i in range(0, len(items), 40):
            yield "\n".join(items[i : i + 40])
    months = [loc.months["format"]["wide"][m] for m in range(1, 13)]
    days = [loc.days["format"]["wide"][d] for d in range(7)]
    yield " ".join(months) + "\n" + " ".join(days)
    lines = []
    for _ in range(120):
        day = datetime.date(1950, 1, 1) + datetime.timedelta(days=rng.randrange(365 * 100))
        fmt = rng.choice(["full", "long", "medium"])
        amount = rng.randrange(1, 10_000_000) / 100
        currency = rng.choice(["EUR", "USD", "JPY", "CNY", "INR", "RUB", "BRL", "GBP"])
        lines.append(
            f"{dates.format_date(day, format=fmt, locale=loc)} — "
            f"{numbers.format_currency(amount, currency, locale=loc)}"
        )
        if len(lines) == 20:
            yield "\n".join(lines)
            lines = []


def _python_docs():
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        doc = inspect.getdoc(module)
        if doc:
            yield doc
        for attr in sorted(dir(module)):
            obj = getattr(module, attr, None)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                yield f"{name}.{attr}\n\n{doc}"


# Share of the text budget per source; Faker fills whatever the others leave.
SHARES = {"python-docs": 0.2, "cldr": 0.3}


def iter_documents(size_mb: float = 4.0, seed: int = 0):
    """Yield (lang, source, text) documents, about `size_mb` MB of UTF-8 text, in a deterministic order."""
    budget = int(size_mb * 1e6)
    rng = random.Random(seed)
    pools = {
        "python-docs": [("en", t) for t in _python_docs()],
        "cldr": [(loc, t) for loc in BABEL_LOCALES for t in _babel_docs(loc, seed)],
    }
    docs: list[tuple[str, str, str]] = []
    total = 0
    for source, share in SHARES.items():
        pool = pools[source]
        rng.shuffle(pool)
        used = 0
        for lang, text in pool:
            if used >= share * budget:
                break
            docs.append((lang, source, text))
            used += len(text.encode())
        total += used
    # Fill the rest of the budget with Faker documents, one locale after the other in turn.
    gens = [(loc.split("_")[0], _faker_docs(loc, seed * 1000 + i, 10**9)) for i, loc in enumerate(FAKER_LOCALES)]
    while total < budget:
        for lang, gen in gens:
            text = next(gen)
            docs.append((lang, "faker", text))
            total += len(text.encode())
    rng.shuffle(docs)
    yield from docs


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for pkg in ("faker", "babel"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def make_demo_corpus(out_dir: str, size_mb: float = 4.0, seed: int = 0, eval_every: int = 50) -> dict:
    """Write `train.jsonl`, `eval.jsonl` and `manifest.json` to `out_dir`; return the manifest.

    Every `eval_every`-th document goes to eval.jsonl. Files are written to temporary names and
    renamed, so a half-written corpus is never mistaken for a finished one.
    """
    try:  # an availability probe: the import is the check
        import babel  # noqa: F401
        import faker  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the demo corpus needs the `demo` extra (pip install faker babel): {e}") from None
    os.makedirs(out_dir, exist_ok=True)
    counts = {"train": 0, "eval": 0}
    nbytes = {"train": 0, "eval": 0}
    langs: dict[str, int] = {}
    digest = hashlib.sha256()
    paths = {s: os.path.join(out_dir, f"{s}.jsonl") for s in counts}
    files = {s: open(p + ".tmp", "w", encoding="utf-8") for s, p in paths.items()}
    try:
        for i, (lang, source, text) in enumerate(iter_documents(size_mb, seed)):
            split = "eval" if i % eval_every == eval_every - 1 else "train"
            line = json.dumps({"text": text, "lang": lang, "source": source}, ensure_ascii=False)
            files[split].write(line + "\n")
            digest.update(line.encode())
            counts[split] += 1
            nbytes[split] += len(text.encode())
            langs[lang] = langs.get(lang, 0) + 1
    finally:
        for f in files.values():
            f.close()
    for split, path in paths.items():
        os.replace(path + ".tmp", path)
    manifest = {
        "seed": seed,
        "size_mb": size_mb,
        "documents": counts,
        "text_bytes": nbytes,
        "languages": dict(sorted(langs.items())),
        "sha256": digest.hexdigest(),
        "versions": _versions(),
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest
