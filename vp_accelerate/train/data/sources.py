"""Which files a recipe's data section names, how `datasets` reads them, and their raw rows.

`expand_files` turns globs into sorted files; `builder_for` picks the `datasets` builder (text / json / parquet)
from `data.file_format` or the extensions; `load_documents` reads the rows as written (`read.py`).
"""

from __future__ import annotations

import glob
import json
import os

from ..recipe.schema import DataSection
from .read import RAW, DataError, first_record_columns, load_rows

_EXT = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def expand_files(patterns: list[str]) -> list[str]:
    """Sorted files matching the globs (sorted so the result does not depend on directory order)."""
    files: list[str] = []
    for pattern in patterns:
        matched = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matched:
            raise FileNotFoundError(f"no file matches {pattern!r}")
        found = [m for m in matched if os.path.isfile(m)]
        if not found:  # a directory named (or only directories matched) is not silently dropped
            raise DataError(
                f"data.files: {pattern!r} is a directory, not a data file; name its files, e.g. "
                f"{os.path.join(pattern, '*.jsonl')!r}"
            )
        files += found
    return files


def extension_format(path: str) -> str | None:
    """text / json / parquet from a file's extension, None when it says nothing."""
    return _EXT.get(os.path.splitext(path)[1].lower())


def format_of(files: list[str], fmt: str) -> str:
    """The `datasets` builder for `files`: `fmt` (text/json/parquet) or, for "auto", from the extensions."""
    if fmt != "auto":
        return fmt
    kinds = {extension_format(f) for f in files}
    if None in kinds:
        bad = [f for f in files if extension_format(f) is None]
        raise DataError(
            f"data.file_format: cannot tell the format of {bad[0]!r}; set data.file_format to text, json or parquet"
        )
    if len(kinds) > 1:
        raise DataError(f"data.files: mixes formats {sorted(kinds)}; use one format per list")
    return kinds.pop()


def file_format(cfg: DataSection) -> str:
    """The `datasets` builder asked for: data.file_format, or the legacy file-format values of data.format."""
    if cfg.format in ("json", "parquet"):
        return cfg.format
    return cfg.file_format


def builder_for(paths: list[str], cfg: DataSection) -> str:
    """The `datasets` builder that reads `paths` (text / json / parquet) under the recipe's data section."""
    fmt = file_format(cfg)
    if fmt == "auto" and cfg.format == "text" and any(extension_format(f) is None for f in paths):
        return "text"  # `format: text` on files of any extension read them as plain text lines (as it always did)
    return format_of(paths, fmt)


def nonempty_paths(files: list[str] | None, key: str = "data.files") -> list[str]:
    """The files the globs name that hold bytes (0-byte files hold no rows, and some builders fail on them)."""
    paths = expand_files(files or [])
    if not paths:
        raise DataError(f"{key}: no files")
    nonempty = [p for p in paths if os.path.getsize(p) > 0]
    if not nonempty:
        raise DataError(f"{key}: the dataset is empty (every file has 0 bytes: {paths[:3]})")
    return nonempty


def load_documents(
    files: list[str] | None,
    hub_id: str | None = None,
    split: str = "train",
    fmt: str = "auto",
    streaming: bool = False,
    name: str | None = None,
    revision: str | None = None,
):
    """A `datasets` Dataset (or IterableDataset when streaming) of raw rows (JSON as written: `read.py`).

    A hub dataset takes its configuration `name` and a `revision` (branch, tag or commit) for a pinned corpus.
    """
    from datasets import load_dataset  # datasets fixes its cache dir when imported: see read.load_rows

    if hub_id and saved_dataset_dir(hub_id):
        return load_saved(hub_id, split, streaming)
    if hub_id:  # offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), datasets reads it from its local cache
        return load_dataset(hub_id, name, split=split, streaming=streaming, revision=revision)
    paths = nonempty_paths(files)  # 0-byte files hold no rows (and some builders fail on them)
    return load_rows(paths, format_of(paths, fmt), streaming)


def saved_dataset_dir(path: str) -> bool:
    """Whether `path` is a folder `datasets.save_to_disk` wrote (a Dataset: state.json; a DatasetDict:
    dataset_dict.json)."""
    path = os.path.expanduser(path)
    return any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


EVAL_SPLITS = ("test", "validation")
"""A DatasetDict's splits that serve as evaluation data when the recipe names no data.eval_files (as TRL's
scripts pass dataset[test_split] as eval_dataset)."""


def eval_split(hub_id: str, split: str, name: str | None = None, revision: str | None = None) -> str | None:
    """The split of `hub_id` (a save_to_disk DatasetDict folder, or a hub-style dataset) that holds its
    evaluation rows (`EVAL_SPLITS`, first found), or None when it has none besides the training `split`."""
    path = os.path.expanduser(hub_id)
    try:
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            with open(os.path.join(path, "dataset_dict.json")) as f:
                names = json.load(f).get("splits", [])
        elif os.path.isfile(os.path.join(path, "state.json")):
            return None  # a single Dataset
        else:
            from datasets import get_dataset_split_names  # see load_documents

            names = get_dataset_split_names(hub_id, name, revision=revision)
    except Exception:  # out of reach or not a DatasetDict: the training split's own read names the problem
        return None
    return next((s for s in EVAL_SPLITS if s in names and s != split), None)


def load_saved(path: str, split: str, streaming: bool):
    """The rows of a `save_to_disk` folder: the Dataset, or the `split` of a DatasetDict (data.hub_split)."""
    from datasets import DatasetDict, load_from_disk  # see load_documents

    ds = load_from_disk(os.path.expanduser(path))
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"data.hub_split: {path} holds the splits {sorted(ds)}, not {split!r}")
        ds = ds[split]
    return ds.to_iterable_dataset() if streaming else ds


def data_columns(docs, paths: list[str], builder: str) -> list[str]:
    """The columns rows have: the dataset's, or for JSON read as written the first record's keys."""
    if RAW not in (docs.column_names or []):
        return list(docs.column_names or [])
    for path in paths:
        columns = first_record_columns(path, builder)
        if columns is not None:
            return columns
    return []
