"""Sources: `config.data.sources` entries -> one epoch of a split's documents, as token arrays.

Each entry is a dict with a `format` and format-specific keys (see docs/data.md). A source becomes
a random-access `grain.MapDataset`, so the pipeline can shard, shuffle and checkpoint it by index.
Documents carry no BOS/EOS; the pipeline frames them.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import sysconfig
import threading
from collections.abc import Sequence

import grain
import ml_collections
import numpy as np

from jaxscale.data import formats, token_files
from jaxscale.errors import ConfigError, JaxscaleError

SPLITS = ("train", "eval")


class _SkippedRecords:
    """Malformed records skipped by this process so far, over all sources and reader threads;
    the trainer logs it as `data_skipped_records`."""

    def __init__(self):
        self._count, self._lock = 0, threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        return self._count


skipped_records = _SkippedRecords()

# Keys every source takes, with defaults; then the keys of each format (None: required).
_COMMON = dict(weight=1.0, eval_fraction=0.02, eval_path="")
FORMATS = {
    "stdlib": {},
    "synthetic": {},
    "text": dict(path=None, document="file"),
    "jsonl": dict(path=None, text_field="text"),
    "parquet": dict(path=None, text_field="text"),
    "array_record": dict(path=None),
    "tokens": dict(path=None),
}
_TEXT_DOCUMENTS = ("file", "line")

# Installed third-party packages live inside the stdlib directory but differ from machine to
# machine; leaving them out keeps the corpus identical wherever this Python version runs.
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")

SYNTHETIC_DOCUMENTS = {"train": 100_000, "eval": 1_000}

_log = logging.getLogger(__name__)


def source_specs(config: ml_collections.ConfigDict) -> list[dict]:
    """`config.data.sources` checked and completed with defaults; ConfigError on any mistake."""
    entries = config.data.sources
    if not isinstance(entries, (tuple, list)) or not entries:
        raise ConfigError(f"data.sources={entries!r} must be a non-empty tuple of dicts, e.g. "
                          "(dict(format='jsonl', path='data/*.jsonl'),)")
    return [_source_spec(i, entry) for i, entry in enumerate(entries)]


def _source_spec(i: int, entry) -> dict:
    where = f"data.sources[{i}]"
    if not isinstance(entry, (dict, ml_collections.ConfigDict)) or "format" not in entry:
        raise ConfigError(f"{where}={entry!r} must be a dict with a 'format' key")
    entry = dict(entry)
    kind = entry.pop("format")
    if kind not in FORMATS:
        raise ConfigError(f"{where}.format={kind!r} is unknown; use one of {tuple(FORMATS)}")
    allowed = {**_COMMON, **FORMATS[kind]}
    for key in entry:
        if key not in allowed:
            raise ConfigError(f"{where} has unknown key {key!r}; a {kind} source takes "
                              f"{sorted(allowed)}")
    spec = {**allowed, **entry, "format": kind, "name": where}
    for key, default in allowed.items():
        if default is None and not spec[key]:
            raise ConfigError(f"{where} ({kind}) needs {key!r}: a file path or glob")
    weight = spec["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise ConfigError(f"{where}.weight={weight!r} must be a number > 0 (weights are relative "
                          "shares of documents)")
    if not 0 < spec["eval_fraction"] < 1:
        raise ConfigError(f"{where}.eval_fraction={spec['eval_fraction']!r} must be in (0, 1)")
    if spec["eval_path"] and kind in ("stdlib", "synthetic"):
        raise ConfigError(f"{where}.eval_path is for file sources; a {kind} source holds out "
                          "its own eval documents")
    if kind == "text" and spec["document"] not in _TEXT_DOCUMENTS:
        raise ConfigError(f"{where}.document={spec['document']!r} must be one of "
                          f"{_TEXT_DOCUMENTS} (one document per file or per line)")
    return spec


def expand_path(pattern: str, where: str) -> tuple[list[str], list[str]]:
    """(files, stable keys): the sorted files `pattern` matches and their paths relative to the
    pattern's fixed directory, so moving the whole data set keeps each document's split."""
    pattern = os.path.expanduser(pattern)
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError(f"{where}={pattern!r} matches no files; check the path (globs like "
                          "data/*.jsonl and data/**/*.txt work)")
    fixed = pattern[:min((pattern.index(c) for c in "*?[" if c in pattern), default=len(pattern))]
    root = os.path.dirname(fixed) if fixed != pattern else os.path.dirname(pattern)
    return files, [os.path.relpath(f, root or ".") for f in files]


def held_out(keys: Sequence[str], counts: Sequence[int], eval_fraction: float) -> np.ndarray:
    """bool[sum(counts)]: which records are held out for eval.

    A hash of (file key, record number) rather than a position in a listing, so adding or
    removing other files never moves a document between train and eval.
    """
    threshold = np.uint64(min(int(eval_fraction * 2.0 ** 64), 2 ** 64 - 1))
    masks = [np.zeros(0, bool)]
    for key, count in zip(keys, counts):
        seed = np.uint64(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little"))
        masks.append(_mix64(np.arange(count, dtype=np.uint64) + seed) < threshold)
    return np.concatenate(masks)


def _mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer: a fast, well-spread 64-bit hash (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def stdlib_files() -> tuple[str, list[str]]:
    """(root, sorted relative paths) of this interpreter's standard-library `.py` files."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _NOT_STDLIB]
        paths += [os.path.relpath(os.path.join(directory, f), root)
                  for f in files if f.endswith(".py")]
    return root, sorted(paths)


def _reader(spec: dict, pattern: str, where: str, tokenizer) -> formats.RecordReader:
    files, keys = expand_path(pattern, where)
    kind = spec["format"]
    if kind == "text":
        return formats.WholeFiles(files, keys) if spec["document"] == "file" \
            else formats.Lines(files, keys)
    if kind == "jsonl":
        return formats.JsonLines(files, keys, spec["text_field"])
    if kind == "parquet":
        return formats.ParquetRows(files, keys, spec["text_field"])
    if kind == "array_record":
        return formats.ArrayRecords(files, keys)
    return token_files.TokenFiles(files, keys, tokenizer.name)


class _Documents:
    """Record index -> token ids, or None for a malformed record (skipped and counted)."""

    def __init__(self, reader, tokenizer, source_name: str, max_bad_records: int):
        self._reader, self._tokenizer = reader, tokenizer
        self._source_name, self._max_bad = source_name, max_bad_records
        self._bad = 0

    def __call__(self, index: int) -> np.ndarray | None:
        try:
            content = self._reader[int(index)]
        except formats.MalformedRecord as e:
            self._bad += 1
            skipped_records.add()
            if self._bad > self._max_bad:
                raise JaxscaleError(
                    f"{self._source_name}: {self._bad} malformed records (latest: {e}); fix the "
                    f"data or raise data.max_bad_records={self._max_bad}") from None
            _log.warning("%s: skipped malformed record %d of at most %d: %s", self._source_name,
                         self._bad, self._max_bad, e)
            return None
        if isinstance(content, np.ndarray):
            return content
        return self._tokenizer.encode(content)


def source_documents(spec: dict, split: str, tokenizer, config: ml_collections.ConfigDict
                     ) -> grain.MapDataset:
    """One epoch of `split`'s documents of one source: token arrays, None for a bad record."""
    kind, where = spec["format"], spec["name"]
    if kind == "synthetic":
        return synthetic_documents(split, config.train.seed, tokenizer,
                                   max_length=2 * config.train.seq_len)
    if kind == "stdlib":
        root, paths = stdlib_files()
        reader = formats.WholeFiles([os.path.join(root, p) for p in paths], paths)
    else:
        key = "eval_path" if split == "eval" and spec["eval_path"] else "path"
        reader = _reader(spec, spec[key], f"{where}.{key}", tokenizer)
    if kind == "stdlib" or not spec["eval_path"]:
        in_eval = held_out(reader.keys, reader.counts, spec["eval_fraction"])
        indices = np.flatnonzero(in_eval if split == "eval" else ~in_eval)
    else:
        indices = np.arange(len(reader))
    if not len(indices):
        raise JaxscaleError(f"{where} has no {split} documents ({len(reader)} in all); "
                            + ("raise its eval_fraction or give an eval_path" if split == "eval"
                               else "lower its eval_fraction or add data"))
    documents = _Documents(reader, tokenizer, where, config.data.max_bad_records)
    return grain.MapDataset.source(indices).map(documents)


def _random_document(seed: int, split: str, first_id: int, vocab_size: int, max_length: int,
                     index: int) -> np.ndarray:
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    length = rng.integers(1, max_length + 1)
    return rng.integers(first_id, vocab_size, size=length, dtype=np.int32)


def synthetic_documents(split: str, seed: int, tokenizer, max_length: int) -> grain.MapDataset:
    """Random documents of 1..`max_length` ordinary tokens, a function of (seed, split, index).

    For benchmarks and tests: no file is read and the content costs almost nothing to make.
    """
    # Ids below 3 are special in the byte tokenizer (and usually in learned ones too).
    first_id = 3
    return grain.MapDataset.range(SYNTHETIC_DOCUMENTS[split]).map(functools.partial(
        _random_document, seed, split, first_id, tokenizer.vocab_size, max_length))
