"""Sources: `config.data.sources` entries -> one epoch of a split's documents, as token arrays.

Each entry is a dict with a `format` and format-specific keys (see docs/data.md), checked by
specs.py; this module lists its files, holds out its eval documents and checks at start-up that each
split has some to read (`check_splits`). A source becomes a random-access `grain.MapDataset`, so the
pipeline can shard, shuffle and checkpoint it by index. Documents carry no BOS/EOS; the pipeline
frames them — except chat documents, which chat.py frames around what their template renders.
"""

from __future__ import annotations

import codecs
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

from jaxscale.data import chat, formats, packing, token_files
from jaxscale.data.specs import describe, source_specs
from jaxscale.data.tokenizers import tokenizer_from_config
from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.runtime.storage import check_bucket, classified, filesystem, in_bucket

SPLITS = ("train", "eval")
_LIST_FIX = "check the path and the bucket's permissions"


class SkippedRecords:
    """Malformed records skipped so far by one input of this process, over all its sources and
    reader threads (`Input.skipped_records()` sums it over the processes)."""

    def __init__(self):
        self._count, self._lock = 0, threading.Lock()

    def add(self) -> None:
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    # `data.prepare` ships the documents (and so this counter) to worker processes: the lock is
    # made anew there, and their counts stay there (prepare logs each skipped record instead).
    def __getstate__(self) -> dict:
        return {"_count": self._count}

    def __setstate__(self, state: dict) -> None:
        self._count, self._lock = state["_count"], threading.Lock()


# Installed third-party packages live inside the stdlib directory but differ from machine to
# machine; leaving them out keeps the corpus identical wherever this Python version runs.
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")

SYNTHETIC_DOCUMENTS = {"train": 100_000, "eval": 1_000}

# Opening a text source reads this many of its documents (spread over the split), at most this
# many bytes of each, and warns when more than this share is not UTF-8 text.
_SAMPLED_DOCUMENTS = 32
_SAMPLED_BYTES = 64 << 10
_MAX_NOT_TEXT = 0.1
_warned_not_text: set[tuple[str, str]] = set()

_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def expand_path(pattern: str, where: str) -> tuple[list[str], list[str]]:
    """(files, stable keys): the sorted files `pattern` (a local path or a URL, gs://, s3://)
    matches and their paths relative to the pattern's fixed directory, so moving the whole data
    set keeps each document's split. Listed once per process: an object store bills (and may
    throttle) every listing, and the splits and checks of one start ask for the same pattern."""
    pattern = os.path.expanduser(pattern)
    files = sorted(_bucket_files(pattern, where) if in_bucket(pattern) else
                   (p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p)))
    if not files:
        raise ConfigError(f"{where}={pattern!r} matches no files; check the path (globs like "
                          "data/*.jsonl and data/**/*.txt work)")
    fixed = pattern[:min((pattern.index(c) for c in "*?[" if c in pattern), default=len(pattern))]
    root = os.path.dirname(fixed) if fixed != pattern else os.path.dirname(pattern)
    return tuple(files), tuple(os.path.relpath(f, root or ".") for f in files)


def _bucket_files(pattern: str, where: str) -> list[str]:
    """The objects `pattern` (gs://..., s3://..., with globs and **) matches, as URLs. A local
    pattern keeps Python's glob, whose rules (hidden files, relative paths) the sources'
    keys were made with."""
    check_bucket(pattern, where)  # s3fs globs a bucket that is not there as no files
    fs, inner = filesystem(pattern, where)
    with classified(f"cannot list {where}={pattern!r}", _LIST_FIX):
        found = fs.glob(inner, detail=True) if glob.has_magic(inner) else \
            {inner: fs.info(inner)} if fs.exists(inner) else {}
    return [fs.unstrip_protocol(p) for p, info in found.items() if info["type"] == "file"]


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


def _reader(spec: dict, pattern: str, where: str, tokenizer_name: str) -> formats.RecordReader:
    files, keys = expand_path(pattern, where)
    kind = spec["format"]
    if kind == "text":
        return formats.WholeFiles(files, keys) if spec["document"] == "file" \
            else formats.Lines(files, keys)
    if kind == "jsonl":
        return formats.JsonLines(files, keys, spec["text_field"], spec["name"])
    if kind == "chat":
        return formats.ChatLines(files, keys, spec["name"])
    if kind == "parquet":
        return formats.ParquetRows(files, keys, spec["text_field"])
    if kind == "array_record":
        return formats.ArrayRecords(files, keys)
    return token_files.TokenFiles(files, keys, tokenizer_name)


class _Documents:
    """Record index -> token ids (or a chat document), None for a record that is skipped and
    counted: a malformed one, or a chat document longer than a row.

    `encode` turns a record's text (or chat record) into its document. A skipped record counts
    once, however often it is read (every pass over a source reads it again, and a stream of a
    small source reads it twice): malformed records stop the run once more than
    `max_bad_records` different ones were found; documents too long do not (they are not
    malformed), unless none of this source's documents has fitted yet — then nothing ever would,
    and the run would wait for a row forever.
    """

    def __init__(self, reader, encode, source_name: str, max_bad_records: int,
                 skipped: SkippedRecords):
        self._reader, self._encode = reader, encode
        self._source_name, self._max_bad = source_name, max_bad_records
        self._bad: set[int] = set()
        self._long: set[int] = set()
        self._fitted, self._skipped = False, skipped
        self._lock = threading.Lock()  # reader threads share the sets

    def __call__(self, index: int) -> np.ndarray | packing.TrainedTokens | None:
        index = int(index)
        try:
            content = self._reader[index]
            document = content if isinstance(content, np.ndarray) else self._encode(content)
        except formats.MalformedRecord as e:
            seen = self._long if e.kind == "long" else self._bad
            with self._lock:
                first_time = index not in seen
                seen.add(index)
                count = len(seen)
            if first_time:
                self._skipped.add()
            if e.kind == "long":
                return self._too_long(e, count, first_time)
            if count > self._max_bad:
                raise JaxscaleError(
                    f"{self._source_name}: {count} malformed records (latest: {e}); fix the "
                    f"data or raise data.max_bad_records={self._max_bad}") from None
            if first_time:
                _log.warning("%s: skipped malformed record %d of at most %d: %s",
                             self._source_name, count, self._max_bad, e)
            return None
        self._fitted = True
        return document

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _too_long(self, e: formats.MalformedRecord, count: int, first_time: bool) -> None:
        if count > self._max_bad and not self._fitted:
            raise JaxscaleError(f"{self._source_name}: none of the {count} documents read "
                                f"so far fits a row (latest: {e}); raise train.seq_len")
        if first_time and count == 1:
            _log.warning("%s: skipped a document too long for a row: %s; such documents are "
                         "skipped and counted in data_skipped_records", self._source_name, e)


def _open_split(spec: dict, split: str, tokenizer_name: str
                ) -> tuple[formats.RecordReader | None, np.ndarray]:
    """(reader, the record indices of `split`) of a source; (None, the indices of its
    documents) for synthetic. Lists and checks its files, reads no document."""
    kind, where = spec["format"], spec["name"]
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; use one of {SPLITS}")
    if kind == "synthetic":
        return None, np.arange(SYNTHETIC_DOCUMENTS[split])
    if kind == "stdlib":
        root, paths = stdlib_files()
        reader = formats.WholeFiles([os.path.join(root, p) for p in paths], paths)
    else:
        key = "eval_path" if split == "eval" and spec["eval_path"] else "path"
        reader = _reader(spec, spec[key], f"{where}.{key}", tokenizer_name)
    if kind == "stdlib" or not spec["eval_path"]:
        in_eval = held_out(reader.keys, reader.counts, spec["eval_fraction"])
        indices = np.flatnonzero(in_eval if split == "eval" else ~in_eval)
    else:
        indices = np.arange(len(reader))
    return reader, indices


def _check_split(spec: dict, split: str, reader: formats.RecordReader | None,
                 indices: np.ndarray, eval_optional: bool = True) -> None:
    """Fails when the split of a source holds no documents or only empty ones; warns when a text
    source's documents are mostly not text. Reads at most a few documents."""
    if reader is None:  # synthetic: never empty
        return
    if not len(indices):
        raise JaxscaleError(_no_documents(spec, split, len(reader), eval_optional))
    has_content = reader.has_content(indices)
    sample = indices[np.unique(np.linspace(0, len(indices) - 1,
                                           min(len(indices), _SAMPLED_DOCUMENTS)).astype(int))]
    contents, malformed = [], 0
    if has_content is None or spec["format"] in ("text", "array_record"):
        for index in sample:
            try:
                contents.append((int(index), reader.sample(int(index), _SAMPLED_BYTES)))
            except formats.MalformedRecord:
                malformed += 1  # skipped and counted when read
    if has_content is None and len(indices) <= _SAMPLED_DOCUMENTS:
        has_content = any(len(content) for _, content in contents)  # every document was read
    if has_content is False:
        n = len(indices)
        state = "empty or malformed" if malformed else "empty"
        raise JaxscaleError(
            f"{describe(spec)} has nothing to read: its {n} {split} "
            f"document{'s are' if n > 1 else ' is'} {state}; put text in "
            + ("its eval_path files" if split == "eval" and spec["eval_path"] else "its files")
            + " or fix the path")
    if spec["format"] in ("text", "array_record"):
        _warn_if_not_text(spec, split, reader, contents)


def _no_documents(spec: dict, split: str, total: int, eval_optional: bool) -> str:
    where, fraction = describe(spec), spec["eval_fraction"]
    without_eval = ", or set train.eval_every=0 to train without eval" if eval_optional else ""
    if split == "eval" and spec["eval_path"]:
        return (f"{spec['name']}.eval_path={spec['eval_path']!r} holds no documents; give eval "
                "files that hold some, or leave eval_path out to hold out eval_fraction of "
                f"path{without_eval}")
    if not total or split == "train" and spec["eval_path"]:
        return f"{where} holds no documents; add data to its files or fix its path"
    if split == "eval":
        eval_path = "" if spec["format"] == "stdlib" else ", give it an eval_path"
        return (f"{where} has no eval documents: eval_fraction={fraction} of its {total} "
                f"documents holds out none; raise its eval_fraction{eval_path}{without_eval}")
    return (f"{where} has no train documents: eval_fraction={fraction} holds out all of its "
            f"{total}; lower its eval_fraction, give it an eval_path, or add data")


def _is_text(content) -> bool:
    if not isinstance(content, bytes):
        return True  # decoded already (JSON, Parquet) or token ids
    if b"\0" in content:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(content,
                                                        final=len(content) < _SAMPLED_BYTES)
    except UnicodeDecodeError:
        return False
    return True


def _warn_if_not_text(spec: dict, split: str, reader: formats.RecordReader,
                      contents: list) -> None:
    binary = [index for index, content in contents if not _is_text(content)]
    if not contents or len(binary) <= _MAX_NOT_TEXT * len(contents):
        return
    key = (spec["name"], spec["eval_path"] if split == "eval" else spec["path"])
    if key in _warned_not_text:
        return
    _warned_not_text.add(key)
    files = sorted({reader.files[reader.locate(index)[0]] for index in binary})
    _log.warning("%s: %d of %d sampled %s documents are not UTF-8 text (in %s%s); is it a "
                 "binary file? Leave such files out of its path or convert them to UTF-8 text",
                 describe(spec), len(binary), len(contents), split, files[0],
                 f" and {len(files) - 1} more files" if len(files) > 1 else "")


def check_splits(config: ml_collections.ConfigDict, splits: Sequence[str] = SPLITS, *,
                 eval_optional: bool = True) -> None:
    """Fails now, with a JaxscaleError naming the source and the fix, if a split that the run
    will use holds no documents (or only empty ones) in some source — rather than at the first
    eval, or after the run has started.

    Cheap enough for every start: it validates `data.sources`, lists each source's files and
    counts their records (a line scan of text/JSONL files, Parquet/ArrayRecord/token metadata),
    and reads at most a few dozen documents per source and split; it tokenizes nothing. The
    default `stdlib` source costs a directory walk, `synthetic` nothing. Also warns (once) when
    a text source is mostly not UTF-8 text. `eval_optional`: whether the message may suggest
    `train.eval_every=0`.
    """
    specs = source_specs(config)
    for split in splits:
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; use one of {SPLITS}")
    tokenizer_name = ""
    if any(spec["format"] == "tokens" for spec in specs):
        tokenizer_name = tokenizer_from_config(config).name
    for spec in specs:
        for split in splits:
            reader, indices = _open_split(spec, split, tokenizer_name)
            _check_split(spec, split, reader, indices, eval_optional)


def source_documents(spec: dict, split: str, tokenizer, config: ml_collections.ConfigDict,
                     skipped: SkippedRecords | None = None) -> grain.MapDataset:
    """One epoch of `split`'s documents of one source: token arrays, None for a bad record
    (counted in `skipped`). JaxscaleError (see `check_splits`) when the split holds no
    documents."""
    if spec["format"] == "synthetic":
        return synthetic_documents(split, config.train.seed, tokenizer,
                                   max_length=2 * config.train.seq_len)
    reader, indices = _open_split(spec, split, tokenizer.name)
    _check_split(spec, split, reader, indices)
    encode = (chat.ChatEncoder(spec, tokenizer, config) if spec["format"] == "chat"
              else tokenizer.encode)
    if spec["format"] == "chat":
        _check_conversations(spec, split, reader, indices, encode, config.train.seq_len)
    documents = _Documents(reader, encode, spec["name"], config.data.max_bad_records,
                           skipped or SkippedRecords())
    return grain.MapDataset.source(indices).map(documents)


def _check_conversations(spec: dict, split: str, reader: formats.RecordReader,
                         indices: np.ndarray, encode, seq_len: int) -> None:
    """Fails at the first read when none of the first conversations of a chat source's split
    can be trained on: none has a token to learn (no assistant turn nor completion: the run would
    train at loss 0), or every one is too long for a row (a line of megabytes would otherwise be
    read and skipped over and over)."""
    learned_nothing, too_long, latest = 0, 0, None
    for index in indices[:formats.CHECKED_RECORDS]:
        try:
            document = encode(reader[int(index)])
        except formats.MalformedRecord as e:  # skipped and counted when read
            if e.kind == "long":
                too_long, latest = too_long + 1, e
            continue
        if document.learned.any():
            return
        learned_nothing += 1
    if learned_nothing:
        raise JaxscaleError(
            f"{describe(spec)}: none of the first {learned_nothing} {split} conversations read "
            "has a token to learn (an assistant message, or a completion), so the run would "
            "train on nothing (loss 0); give the conversations assistant replies (the loss falls "
            "on them only)")
    if too_long:
        raise JaxscaleError(
            f"{describe(spec)}: none of the first {too_long} {split} conversations read fits a "
            f"row (latest: {latest}); raise train.seq_len, or split the long conversations")


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
