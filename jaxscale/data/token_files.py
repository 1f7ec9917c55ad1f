"""Pre-tokenized files: documents stored once as token ids, each read with one ranged read
(`os.pread` on a local disk, a ranged GET in a bucket).

`NAME.bin` is the flat token array (uint16 when the vocabulary fits, else uint32), `NAME.idx.npy`
the int64 offsets where documents start (plus the end), and `NAME.json` says which tokenizer made
them, so a run with another tokenizer is refused rather than trained on the wrong ids. The
tokens are not memory-mapped: a failed read of a mapped page kills the process with SIGBUS,
where `pread` raises an error that says whether to retry (`runtime.storage`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import numpy as np

from jaxscale.data.formats import (
    MalformedRecord,
    RecordReader,
    file_size,
    open_file,
    open_for_reading,
    read_at,
    read_failed,
)
from jaxscale.errors import JaxscaleError, json_object
from jaxscale.runtime.storage import filesystem, library_errors

FORMAT = "jaxscale-tokens-v1"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def write_token_file(stem: str, documents: Iterable[np.ndarray], vocab_size: int,
                     tokenizer: str) -> dict:
    """Writes `stem`.bin/.idx.npy/.json (on a local disk or in a bucket) from token arrays, in
    order; returns the metadata."""
    dtype = token_dtype(vocab_size)
    offsets = [0]
    fs, inner = filesystem(stem, "--out")
    with fs.open(inner + ".bin", "wb") as f:
        for tokens in documents:
            f.write(np.asarray(tokens).astype(dtype).tobytes())
            offsets.append(offsets[-1] + len(tokens))
    with fs.open(inner + ".idx.npy", "wb") as f:
        np.save(f, np.asarray(offsets, dtype=np.int64))
    meta = {"format": FORMAT, "dtype": dtype.name, "vocab_size": vocab_size,
            "tokenizer": tokenizer, "documents": len(offsets) - 1, "tokens": offsets[-1]}
    # The metadata goes last: a file set without it is an interrupted write, never read.
    fs.pipe_file(inner + ".json", json.dumps(meta, indent=2).encode())
    return meta


def _stem(path: str) -> str:
    if not path.endswith(".bin"):
        raise JaxscaleError(f"token file {path!r} should end in .bin (written by "
                            "`python -m jaxscale.data.prepare`)")
    return path[:-len(".bin")]


_FIX = "write it with `python -m jaxscale.data.prepare`"


def read_metadata(path: str) -> dict:
    stem = _stem(path)
    try:
        with open_file(stem + ".json") as f:
            meta = json.load(f)
    except (FileNotFoundError, ValueError) as e:
        raise JaxscaleError(f"token file {path!r} has no readable {stem}.json ({e}); {_FIX}") \
            from None
    except (OSError, *library_errors()) as e:
        raise read_failed(e, stem + ".json") from e
    if json_object(meta, f"{stem}.json", _FIX).get("format") != FORMAT:
        raise JaxscaleError(f"{stem}.json is not a {FORMAT} description; rewrite the files with "
                            "`python -m jaxscale.data.prepare`")
    return meta


class TokenFiles(RecordReader):
    """One document per entry of each file's offset index, as int32 token ids."""

    def __init__(self, files: Sequence[str], keys: Sequence[str], tokenizer: str):
        self.offsets, dtypes = [], []
        for path in files:
            meta = read_metadata(path)
            if meta["tokenizer"] != tokenizer:
                raise JaxscaleError(
                    f"{path!r} was tokenized with {meta['tokenizer']!r} but data.tokenizer gives "
                    f"{tokenizer!r}; use the same tokenizer or prepare the files again")
            index = _stem(path) + ".idx.npy"
            try:
                with open_file(index) as f:
                    offsets = np.load(f)
                size = file_size(path)
            except (FileNotFoundError, ValueError) as e:
                raise JaxscaleError(f"token file {path!r} has no readable {index} ({e}); prepare "
                                    "it again with `python -m jaxscale.data.prepare`") from None
            except (OSError, *library_errors()) as e:
                raise read_failed(e, getattr(e, "filename", None) or path) from e
            dtype = np.dtype(meta["dtype"])
            if size != offsets[-1] * dtype.itemsize or len(offsets) != meta["documents"] + 1:
                raise JaxscaleError(
                    f"token file {path!r} is {size} bytes but its index describes "
                    f"{offsets[-1] * dtype.itemsize}; it is truncated or mismatched — prepare "
                    "it again")
            self.offsets.append(offsets)
            dtypes.append(dtype)
        super().__init__(files, keys, [len(o) - 1 for o in self.offsets])
        self._dtypes = dtypes
        self._lengths = np.concatenate([np.diff(o) for o in self.offsets] or [np.zeros(0, int)])

    def has_content(self, indices: np.ndarray) -> bool:
        return bool(self._lengths[np.asarray(indices, dtype=np.int64)].any())

    def read(self, file: int, record: int) -> np.ndarray:
        dtype, path = self._dtypes[file], self.files[file]
        start, end = self.offsets[file][record], self.offsets[file][record + 1]
        size = int(end - start) * dtype.itemsize
        data = read_at(self.handle(file, open_for_reading), size, int(start) * dtype.itemsize,
                       path)
        if len(data) != size:
            raise MalformedRecord(f"{path} document {record}: file shrank while read")
        return np.frombuffer(data, dtype).astype(np.int32)
