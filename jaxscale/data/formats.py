"""Random access to the records (documents) stored in files of each supported format.

A reader maps a record index over all its files to the document's raw content: text (`bytes` or
`str`), token ids (`np.ndarray`) or a chat record (`dict`, see `ChatLines`). Everything a run
could trip over later — a missing field, a truncated file — is checked when the reader is built,
so it fails at start-up with one line. A record whose bytes were read and do not parse raises
`MalformedRecord`, which the pipeline skips and counts. A read that fails is never a malformed
record: it raises what `runtime.storage` makes of it (exit 2 when refused or gone, exit 75 when
the storage fails), so no document is skipped because the disk failed once. Readers open files
lazily in whichever process reads, so they pickle cheaply to grain workers.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import re
import threading
from collections.abc import Sequence

import numpy as np

from jaxscale.errors import ConfigError, JaxscaleError, TransientError, json_object
from jaxscale.runtime.storage import (
    filesystem,
    in_bucket,
    library_error,
    library_errors,
    reason,
    storage_error,
)

_SCAN_CHUNK = 64 << 20  # bytes read at a time when indexing lines


_READ_FIX = "make it readable again, or leave it out of the source's path"


def read_failed(error: Exception, path: str) -> ConfigError | TransientError:
    """What a failed read of the source file `path` raises: exit 2 when it was refused or is
    gone, exit 75 when the storage fails (EIO, a timeout, a server's 5xx once its library's
    retries are spent, ...). `error`: an OSError, or one of the buckets' `library_errors()`."""
    if isinstance(error, OSError):
        return storage_error(error, f"cannot read {path!r} ({reason(error)})", _READ_FIX)
    return library_error(error, f"cannot read {path!r}", _READ_FIX)


def read_at(handle, size: int, offset: int, path: str) -> bytes:
    """`size` bytes of `path` from `offset`, `handle` being what `open_for_reading` returned:
    one read at an offset, so an I/O error is an exception (a memory map would die of SIGBUS)
    and threads share no seek position. On a local disk `os.pread` of the open file (no open per
    read); in a bucket one ranged GET."""
    try:
        if isinstance(handle, int):
            return os.pread(handle, size, offset)
        fs, inner = handle
        return fs.cat_file(inner, start=offset, end=offset + size)
    except (OSError, *library_errors()) as e:  # gcsfs' 5xx after its retries: no OSError
        raise read_failed(e, path) from e


def open_for_reading(path: str):
    """What `read_at` reads `path` with: an open file descriptor on a local disk, the bucket's
    filesystem and the path in it for a URL (nothing to open: each read is a request)."""
    if in_bucket(path):
        return filesystem(path, "a data source's path")
    try:
        return os.open(path, os.O_RDONLY)
    except OSError as e:
        raise read_failed(e, path) from e


def open_file(path: str):
    """`path` opened for reading as a binary file object, on a local disk or in a bucket."""
    fs, inner = filesystem(path, "a data source's path")
    return fs.open(inner, "rb")


def file_size(path: str) -> int:
    fs, inner = filesystem(path, "a data source's path")
    return fs.size(inner)


class MalformedRecord(Exception):
    """One record cannot be read or parsed; the rest of the data is fine.

    `kind` says what is wrong: "unreadable", "json" (not JSON), "shape" (JSON but not an object),
    "field" (no such field), "type" (the field is not what it should be), "template" (a chat
    template cannot render it) or "long" (a chat document longer than a row: not malformed, but
    skipped and counted the same way).
    """

    def __init__(self, message: str, kind: str = "unreadable"):
        super().__init__(message)
        self.kind = kind


class RecordReader:
    """Record `i` of the concatenation of `files`, each holding `counts[f]` records.

    `keys` name the files stably (relative to the source's root) for the held-out split.
    """

    def __init__(self, files: Sequence[str], keys: Sequence[str], counts: Sequence[int]):
        self.files, self.keys = list(files), list(keys)
        self.counts = np.asarray(counts, dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.counts)])
        self._lock = threading.RLock()
        self._handles: dict[int, object] = {}

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(file number, record number within that file) of record `index`."""
        file = int(np.searchsorted(self._starts, index, side="right")) - 1
        return file, int(index - self._starts[file])

    def __getitem__(self, index: int):
        file, record = self.locate(index)
        return self.read(file, record)

    def read(self, file: int, record: int):
        raise NotImplementedError  # each format reads its own way

    def sample(self, index: int, limit: int):
        """At least the first `limit` bytes (or characters, or tokens) of record `index`: enough
        to tell what it holds without reading a whole large file."""
        return self[index]

    def has_content(self, indices: np.ndarray) -> bool | None:
        """Whether any of the records `indices` is non-empty, where that is cheap to know exactly
        (without reading them); None where it is not."""
        return None

    def handle(self, file: int, open_file):
        """The open handle of `file` in this process, opened on first use by `open_file(path)`."""
        with self._lock:
            if file not in self._handles:
                self._handles[file] = open_file(self.files[file])
            return self._handles[file]

    def __getstate__(self):
        # Handles belong to the process that opened them; a worker opens its own.
        state = dict(self.__dict__)
        state["_handles"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.RLock()


class WholeFiles(RecordReader):
    """One document per file: its bytes."""

    def __init__(self, files: Sequence[str], keys: Sequence[str]):
        # A bucket says whether it lets this process read only when asked for the object.
        unreadable = [f for f in files if not in_bucket(f) and not os.access(f, os.R_OK)]
        if unreadable:
            raise JaxscaleError(f"cannot read {unreadable[0]!r} (and {len(unreadable) - 1} more); "
                                "fix its permissions or leave it out of the source's path")
        super().__init__(files, keys, [1] * len(files))

    def read(self, file: int, record: int, limit: int = -1) -> bytes:
        try:
            with open_file(self.files[file]) as f:
                return f.read(limit)
        except (OSError, *library_errors()) as e:
            raise read_failed(e, self.files[file]) from e

    def sample(self, index: int, limit: int) -> bytes:
        return self.read(self.locate(index)[0], 0, limit)

    def has_content(self, indices: np.ndarray) -> bool:
        for i in indices:
            path = self.files[self.locate(int(i))[0]]
            try:
                if file_size(path):
                    return True
            except (OSError, *library_errors()) as e:
                raise read_failed(e, path) from e
        return False


def line_spans(path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(int64[lines, 2] (start, end) byte offsets of the non-empty lines of `path`, without their
    newline — a last line without a newline counts too —, and their 1-based line numbers in the
    file, or None when they are simply 1, 2, ... because no empty line comes before the last)."""
    newlines, size = [], 0
    try:
        with open_file(path) as f:
            while chunk := f.read(_SCAN_CHUNK):
                newlines.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + size)
                size += len(chunk)
    except (OSError, *library_errors()) as e:
        raise read_failed(e, path) from e
    ends = np.concatenate(newlines + [[size]]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    spans = np.stack([starts, ends], axis=1)
    kept = ends > starts
    last = int(np.flatnonzero(kept)[-1]) if kept.any() else -1
    numbers = None if kept[:last + 1].all() else np.flatnonzero(kept) + 1
    return spans[kept], numbers


class Lines(RecordReader):
    """One document per non-empty line; `parse(line_bytes, where)` turns a line into content."""

    def __init__(self, files: Sequence[str], keys: Sequence[str]):
        spans, self._line_numbers = [], []
        for path in files:
            file_spans, numbers = line_spans(path)
            spans.append(file_spans)
            self._line_numbers.append(numbers)
        super().__init__(files, keys, [len(s) for s in spans])
        self._spans = np.concatenate(spans) if spans else np.zeros((0, 2), np.int64)

    def has_content(self, indices: np.ndarray) -> bool:
        return len(indices) > 0  # only non-empty lines are records

    def where(self, file: int, record: int) -> str:
        """"FILE line N": where record `record` of `file` is, counting empty lines too."""
        numbers = self._line_numbers[file]
        return f"{self.files[file]} line {record + 1 if numbers is None else numbers[record]}"

    def line(self, file: int, record: int) -> bytes:
        start, end = self._spans[self._starts[file] + record]
        fd = self.handle(file, open_for_reading)
        data = read_at(fd, int(end - start), int(start), self.files[file])
        if len(data) != end - start:
            raise MalformedRecord(f"{self.where(file, record)}: file shrank while read")
        return data

    def read(self, file: int, record: int) -> bytes:
        return self.line(file, record)


# JSONL: how many records from the start are tried before the file is taken for something else.
CHECKED_RECORDS = 32


class JsonLines(Lines):
    """One document per line of JSON: the string in field `text_field`.

    `source` names the config entry in messages (e.g. "data.sources[0]").
    """

    def __init__(self, files: Sequence[str], keys: Sequence[str], text_field: str,
                 source: str = "the source"):
        super().__init__(files, keys)
        self.text_field = text_field
        self._check_start(source)

    def _check_start(self, source: str) -> None:
        """Fails when none of the first records is usable: a wrong text_field, or a file that is
        not JSON Lines, is a config mistake, not a bad record. One usable record is enough: any
        other bad one is skipped and counted when read."""
        problems = []
        for index in range(min(len(self), CHECKED_RECORDS)):
            try:
                self[index]
                return
            except MalformedRecord as e:
                problems.append(e)
        if not problems:
            return  # no records at all: the caller reports an empty split
        tried = (f"none of the first {len(problems)} lines has one" if len(problems) > 1
                 else "it is the only line")
        objects = [e for e in problems if e.kind in ("field", "type")]
        if objects:  # JSON objects, but not with what a record needs
            raise JaxscaleError(f"{objects[0]} and {tried}; {self._fix(source)}") from None
        tried = (f"nor is any of the first {len(problems)} lines" if len(problems) > 1
                 else "and it is the only line")
        raise JaxscaleError(f"{problems[0]}, {tried}; a JSONL file holds one JSON object per "
                            f"line, e.g. {self._example}: fix the file, or read plain text with "
                            f"{source}.format='text'") from None

    _example = '{"text": "..."}'

    def _fix(self, source: str) -> str:
        return f"set {source}.text_field to the field that holds the text"

    def has_content(self, indices: np.ndarray) -> None:
        return None  # a non-empty line may hold an empty text

    def json_object(self, file: int, record: int, holding: str) -> dict:
        """The JSON object on the line of `record`; `holding` says what it should hold."""
        where = self.where(file, record)
        try:
            value = json.loads(self.line(file, record))
        except ValueError as e:
            raise MalformedRecord(f"{where} is not JSON ({e})", "json") from e
        return json_object(value, where, f"each line holds an object with {holding}",
                           functools.partial(MalformedRecord, kind="shape"))

    def read(self, file: int, record: int) -> str:
        where = self.where(file, record)
        value = self.json_object(file, record, f"a {self.text_field!r} field")
        if self.text_field not in value:
            raise MalformedRecord(f"{where} has no text field {self.text_field!r} (has "
                                  f"{sorted(value)})", "field")
        text = value[self.text_field]
        if not isinstance(text, str):
            raise MalformedRecord(f"{where}: field {self.text_field!r} is "
                                  f"{type(text).__name__}, not a string", "type")
        return text


# The roles a chat message may have; the chat template decides how each is rendered.
ROLES = ("system", "user", "assistant")


class ChatLines(JsonLines):
    """One conversation per line of JSON, either
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]} (other keys
    of a message go to the template as they are; keys whose value is null are dropped, as
    `transformers` does) or {"prompt": "...", "completion": "..."}. The content is checked here;
    jaxscale/data/chat.py turns it into tokens."""

    _example = '{"messages": [{"role": "user", "content": "..."}, ...]}'

    def __init__(self, files: Sequence[str], keys: Sequence[str], source: str = "the source"):
        super().__init__(files, keys, "messages", source)

    def _fix(self, source: str) -> str:
        return (f"each line of {source} needs \"messages\": a list of {{\"role\": one of {ROLES}, "
                '"content": a string}, or "prompt" and "completion" strings')

    def read(self, file: int, record: int) -> dict:
        where = self.where(file, record)
        value = self.json_object(file, record, '"messages", or "prompt" and "completion"')
        if "messages" in value:
            messages = value["messages"]
            if not isinstance(messages, list) or not messages:
                raise MalformedRecord(f"{where}: \"messages\" is {_short(messages)}, not a "
                                      "non-empty list of messages", "type")
            return {"messages": [_message(m, f"{where} message {i}")
                                 for i, m in enumerate(messages)]}
        if "prompt" in value and "completion" in value:
            for key in ("prompt", "completion"):
                if not isinstance(value[key], str):
                    raise MalformedRecord(f"{where}: {key!r} is {type(value[key]).__name__}, "
                                          "not a string", "type")
            return {"prompt": value["prompt"], "completion": value["completion"]}
        raise MalformedRecord(f'{where} has no "messages", nor "prompt" and "completion" (has '
                              f"{sorted(value)})", "field")


def _message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise MalformedRecord(f"{where} is {_short(message)}, not an object with a role and "
                              "content", "type")
    message = {k: v for k, v in message.items() if v is not None}
    if message.get("role") not in ROLES:
        raise MalformedRecord(f"{where} has role {_short(message.get('role'))}; a role is one "
                              f"of {ROLES}", "type")
    if not isinstance(message.get("content"), str):
        raise MalformedRecord(f"{where}: content is {_short(message.get('content'))}, not a "
                              "string", "type")
    return message


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class ArrayRecords(RecordReader):
    """One document per ArrayRecord record: its bytes, the document's UTF-8 text."""

    def __init__(self, files: Sequence[str], keys: Sequence[str]):
        if in_bucket_files := [f for f in files if in_bucket(f)]:
            # array_record's reader opens local files only (its Python module takes a path, not
            # a file object), so a bucket's file would have to be copied first.
            raise ConfigError(f"ArrayRecord file {in_bucket_files[0]!r} is in a bucket, which "
                              "the ArrayRecord reader cannot read; copy the files to local disk, "
                              "or tokenize them into the bucket with `python -m "
                              "jaxscale.data.prepare` (token files read from buckets)")
        counts = [len(self._open(f)) for f in files]
        super().__init__(files, keys, counts)

    @staticmethod
    def _open(path: str):
        import grain  # array_record loads only for sources that use it

        try:
            return grain.sources.ArrayRecordDataSource([path])
        except (RuntimeError, ValueError) as e:  # array_record's errors, bad files and reads
            if failed := failed_system_call(e, path):
                raise read_failed(failed, path) from e
            raise JaxscaleError(f"cannot open ArrayRecord file {path!r}: "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                                "is it complete and an ArrayRecord file?") from None

    def read(self, file: int, record: int) -> bytes:
        path = self.files[file]
        try:
            return self.handle(file, self._open)[record]
        except (RuntimeError, ValueError) as e:
            if failed := failed_system_call(e, path):
                raise read_failed(failed, path) from e
            # A damaged chunk inside an otherwise good file.
            raise MalformedRecord(f"{path} record {record}: {e}") from e


# Riegeli (under array_record) reports a failed system call as "pread() failed: <strerror>; ...".
_FAILED_CALL = re.compile(r"\b\w+\(\) failed: ([^;]+)")
_ERRNO_OF_WORDS = {os.strerror(number): number for number in errno.errorcode}


def failed_system_call(error: Exception, path: str) -> OSError | None:
    """The OSError behind an array_record error that reports a failed system call (it raises a
    RuntimeError with the words of its errno); None for any other error (a damaged file)."""
    found = _FAILED_CALL.search(str(error))
    number = found and _ERRNO_OF_WORDS.get(found[1].strip())
    return OSError(number, found[1].strip(), path) if number else None


class ParquetRows(RecordReader):
    """One document per Parquet row: the string in column `text_field`.

    Rows are read a row group at a time and the last few groups are kept, because a shuffled
    order jumps between groups; for large shuffled corpora, tokenize once with
    `python -m jaxscale.data.prepare` instead.
    """

    _CACHED_GROUPS = 4

    def __init__(self, files: Sequence[str], keys: Sequence[str], text_field: str):
        counts, group_rows = [], []
        for path in files:
            try:
                metadata = parquet_file(path).metadata
            except library_errors() as e:  # a bucket's, through pyarrow's reads of the file
                raise read_failed(e, path) from e
            except OSError as e:
                if e.errno is not None:  # a failed system call; pyarrow's others have no errno
                    raise read_failed(e, path) from e
                raise JaxscaleError(f"cannot read Parquet file {path!r}: {e}; is it complete?") \
                    from None
            except ValueError as e:  # ArrowInvalid: not Parquet, or truncated
                raise JaxscaleError(f"cannot read Parquet file {path!r}: {e}; is it complete?") \
                    from None
            names = metadata.schema.names
            if text_field not in names:
                raise JaxscaleError(f"Parquet file {path!r} has no column {text_field!r} (has "
                                    f"{names}); set the source's text_field to the text column")
            counts.append(metadata.num_rows)
            group_rows.append(np.cumsum([0] + [metadata.row_group(g).num_rows
                                               for g in range(metadata.num_row_groups)]))
        super().__init__(files, keys, counts)
        self.text_field = text_field
        self._group_starts = group_rows
        self._groups: dict[tuple[int, int], list] = {}

    def read(self, file: int, record: int) -> str:
        group = int(np.searchsorted(self._group_starts[file], record, side="right")) - 1
        rows = self._group(file, group)
        text = rows[record - self._group_starts[file][group]]
        if not isinstance(text, str):
            raise MalformedRecord(f"{self.files[file]} row {record}: column "
                                  f"{self.text_field!r} is {type(text).__name__}, not a string")
        return text

    def _group(self, file: int, group: int) -> list:
        # One decode at a time: a pyarrow ParquetFile crashes when threads read it at once.
        with self._lock:
            rows = self._groups.get((file, group))
            if rows is None:
                path = self.files[file]
                try:
                    rows = self.handle(file, parquet_file) \
                        .read_row_group(group, columns=[self.text_field]) \
                        .column(0).to_pylist()
                except library_errors() as e:  # a bucket's, through pyarrow's reads
                    raise read_failed(e, path) from e
                except (OSError, ValueError) as e:
                    if isinstance(e, OSError) and e.errno is not None:  # a failed system call
                        raise read_failed(e, path) from e
                    # pyarrow's words for bytes that do not decode (ArrowInvalid, or no errno)
                    raise MalformedRecord(f"{path} row group {group}: {e}") from e
                if len(self._groups) >= self._CACHED_GROUPS:
                    self._groups.pop(next(iter(self._groups)))
                self._groups[(file, group)] = rows
            return rows

    def __getstate__(self):
        state = super().__getstate__()
        state["_groups"] = {}
        return state


def parquet_file(path: str):
    """`path` as a pyarrow ParquetFile: from a local disk, or from a bucket through a file object
    whose reads are ranged GETs (pyarrow reads the footer, then only the row groups asked for)."""
    pq = _pyarrow_parquet()
    return pq.ParquetFile(open_file(path) if in_bucket(path) else path)


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq  # optional: only Parquet sources need it
    except ImportError:
        raise JaxscaleError("Parquet sources need pyarrow; pip install 'jaxscale[data]'") from None
    return pq
