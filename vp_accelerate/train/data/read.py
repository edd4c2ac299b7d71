"""Reading local data files into `datasets` rows without changing their values, and naming a row's place.

JSON is not parsed by `datasets`' JSON builder: pyarrow infers one type per column over a block of rows, so
one row with `"content": [{"type": "text", ...}]` turns every other row's content into a JSON-typed value
(an answer `"74."` comes back as `74.0`), and a malformed line stops the read with a pyarrow traceback.
Instead every JSON Lines file is read as lines (the `text` builder, cached and streamable like any
dataset): the column `_raw` holds each line as written, and the tokenizer parses it row by row, so values
stay what the file says, and a bad line is one bad row named by its file and 1-based line. A `.json` file
that is one array of records is read the same way, one element per row (not streamable).
"""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import xxhash

from .identity import files_identity

RAW = "_raw"
"""The column holding one JSON record as written."""

WHERE = "_where"
"""The column naming each record's place, for files read record by record (JSON arrays)."""


class DataError(ValueError):
    """A data problem, with the file or row it concerns (`data.DataError`)."""


def json_layout(path: str) -> str:
    """ "lines" (one record per line, JSON Lines) or "array" (the file is one JSON list of records)."""
    if path.lower().endswith(".jsonl"):
        return "lines"
    with open(path, encoding="utf-8", errors="replace") as f:
        first = ""
        for line in f:  # the first non-blank line (read alone: lines of a big file may be long)
            if line.strip():
                first = line.lstrip("\ufeff").strip()
                break
    if first.startswith("["):
        return "array"
    if first == "{":  # a pretty-printed object: one record, not a data set
        raise DataError(
            f"data.files: {path} holds one JSON object; a data file holds one record per line (JSON "
            f"Lines) or a list of records"
        )
    return "lines"


def _array_of(path: str) -> list:
    """The records of a file that is one JSON array; DataError naming the file when it is not."""
    with open(path, encoding="utf-8") as f:
        try:
            records = json.load(f)
        except RecursionError:  # json's parser recurses per level
            raise DataError(
                f"data.files: {path} is not valid JSON (nested deeper than the parser's limit); a .json data file "
                f"is one array of records or one record per line"
            ) from None
        except json.JSONDecodeError as e:
            raise DataError(
                f"data.files: {path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                f"{e.colno}); a .json data file is one array of records or one record per line"
            ) from None
    if not isinstance(records, list):
        raise DataError(f"data.files: {path} holds a JSON {type(records).__name__}, not an array of records")
    return records


def _array_records(files: list):
    """Rows of JSON-array files (`Dataset.from_generator`): each element as JSON text, with its place.
    `files` carries (path, size, mtime, content hash) so the cached result is redone when a file changes."""
    for path, *_ in files:
        for k, record in enumerate(_array_of(path)):
            yield {RAW: json.dumps(record, ensure_ascii=False), WHERE: f"{path}, record {k + 1}"}


def first_non_utf8(path: str) -> str | None:
    """ "FILE, line N, column C: byte 0xXX is not UTF-8" for the first such byte of a text file, else None (read
    line by line: called only after a read failed)."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{path}, line {n}, column {e.start + 1}: byte {raw[e.start]:#04x} is not UTF-8"
    return None


def _utf8_or_fail(paths: list[str], err: Exception) -> None:
    """After `datasets` failed reading text files: a DataError naming the file and line of a non-UTF-8 byte
    (datasets' DatasetGenerationError names neither), else the original error."""
    for path in paths:
        where = first_non_utf8(path)
        if where:
            raise DataError(f"data.files: {where}; save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    raise err


def load_rows(paths: list[str], builder: str, streaming: bool = False):
    """A `datasets` Dataset (IterableDataset when streaming) of the rows of local files.

    builder: text (a row per line, column `text`), json (column `_raw`, see the module doc) or parquet.
    """
    try:
        return _load_rows(paths, builder, streaming)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets wraps a decode error in DatasetGenerationError
        if builder == "parquet" or not _caused_by(e, UnicodeDecodeError):
            raise
        _utf8_or_fail(paths, e)


def _caused_by(err: BaseException, kind: type) -> bool:
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _load_rows(paths: list[str], builder: str, streaming: bool = False):
    # datasets reads HF_DATASETS_CACHE once, when imported: imported when rows are first read, so a process
    # started before the cache dir was chosen (a preloaded fork server's ranks) still uses the chosen one
    from datasets import Dataset, Features, Value, load_dataset

    # datasets keys a local file's rows by its path and mtime: a config name made of the files' content identity
    # makes a file rewritten with its mtime kept (cp -p, rsync -a, tar x) read again, not taken from the cache
    version = "vp-" + xxhash.xxh3_64_hexdigest(json.dumps(files_identity(paths)).encode())
    if builder == "text":
        return load_dataset("text", version, data_files=paths, split="train", streaming=streaming)
    if builder == "parquet":
        return load_dataset("parquet", version, data_files=paths, split="train", streaming=streaming)
    layouts = {p: json_layout(p) for p in paths}
    if all(kind == "lines" for kind in layouts.values()):
        return load_dataset(
            "text",
            version,
            data_files=paths,
            split="train",
            streaming=streaming,
            features=Features({RAW: Value("string")}),
        )
    arrays = [p for p, kind in layouts.items() if kind == "array"]
    if streaming:
        raise DataError(
            f"data.streaming: {arrays[0]} is one JSON array, which cannot be streamed; write it as JSON "
            f"Lines (one record per line, .jsonl) or set data.streaming: false"
        )
    lines = [p for p, kind in layouts.items() if kind == "lines"]
    if lines:
        raise DataError(f"data.files: mixes JSON Lines ({lines[0]}) and JSON arrays ({arrays[0]}); use one layout")
    for path in paths:  # an error inside the builder would reach the user as datasets' DatasetGenerationError
        _array_of(path)
    stamp = [(p, os.path.getsize(p), os.stat(p).st_mtime_ns, files_identity([p])[0]["xxh3_128"]) for p in paths]
    return Dataset.from_generator(
        _array_records, gen_kwargs={"files": stamp}, features=Features({RAW: Value("string"), WHERE: Value("string")})
    )


def _line_count(path: str) -> int:
    """Rows the `text` builder makes of a file: its lines after universal-newline translation, as it reads them."""
    n = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for _ in f:
            n += 1
    return n


class RowLocator:
    """Row index in the concatenated files -> "FILE, line N" (1-based), or "FILE, row N" for parquet.

    Per-file row counts are read on first use (only when a row must be named).
    """

    def __init__(self, paths: list[str], builder: str, source: str):
        self.paths, self.builder, self.source = paths, builder, source
        self._counts: list[int] = []

    def _count(self, path: str) -> int:
        if self.builder == "parquet":
            return pq.ParquetFile(path).metadata.num_rows
        return _line_count(path)

    def __call__(self, index: int) -> str:
        unit = "row" if self.builder == "parquet" else "line"
        if len(self.paths) == 1:
            return f"{self.paths[0]}, {unit} {index + 1}"
        if not self._counts:
            self._counts = [self._count(p) for p in self.paths]
        for path, n in zip(self.paths, self._counts):
            if index < n:
                return f"{path}, {unit} {index + 1}"
            index -= n
        return f"{self.source}, {unit} {index + 1}"


def first_record_columns(path: str, fmt: str) -> list[str] | None:
    """The columns of a local file's first record (None when it has none to read), without loading the file."""
    if fmt == "text":
        return ["text"]
    if fmt == "parquet":
        return list(pq.read_schema(path).names)
    if json_layout(path) == "array":
        first = next((r for r in _array_of(path) if isinstance(r, dict)), None)
        return sorted(first) if first is not None else None
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.lstrip("\ufeff"))
            except (json.JSONDecodeError, RecursionError):
                continue  # a bad line is reported as a bad row by the data check; the columns come from a good one
            if isinstance(record, dict):
                return sorted(record)
    return None
