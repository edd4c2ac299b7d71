"""Training data: read a recipe's files, tokenize rows into ids and loss masks, pack them into sequences, and
batch them per replica. `prepare_data` (prepare.py) runs the steps in order; each step has its own module:

  sources.py        which files `data.files` names and which `datasets` builder reads them
  read.py           rows as written (JSON parsed row by row), and a row's file and line
  formats.py        the sample format of a row (text / chat / prompt_completion) and its ids and loss mask
  chat_rows.py      chat rows as they come in files, made into the messages a template renders
  chat_template.py  which chat template a run trains with, and the special tokens it needs
  tokenize.py       the `datasets.map` step that tokenizes a split (cached), and its invalid rows
  pack.py           token rows into fixed-length sequences (packed, padded, or by documents)
  stats.py          what a split held (`SplitStats`)
  batches.py        the training and evaluation iterators
  check.py          `--check`'s data report
"""

from .batches import BatchIterator, EvalBatches, Sequences, StreamingBatchIterator, pack_stream
from .pack import pack, pack_documents, pad_rows
from .prepare import BadRowsError, PreparedData, build_data, no_eval_message, prepare_data
from .read import DataError
from .sources import expand_files, load_documents
from .stats import SplitStats
from .tokenize import is_heldout

__all__ = [
    "BadRowsError",
    "BatchIterator",
    "DataError",
    "EvalBatches",
    "PreparedData",
    "Sequences",
    "SplitStats",
    "StreamingBatchIterator",
    "build_data",
    "expand_files",
    "is_heldout",
    "load_documents",
    "no_eval_message",
    "pack",
    "pack_documents",
    "pack_stream",
    "pad_rows",
    "prepare_data",
]
