"""Tokenizers: text -> token ids, with the special ids the pipeline frames documents with."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Every byte is a token: nothing to download, nothing unknown, 259 ids in all.

    Ids 0-2 are reserved so that padding (0) is never a real token.
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2
    _offset = 3
    vocab_size = 256 + _offset

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32) + self._offset

    def decode(self, ids: np.ndarray) -> bytes:
        ids = np.asarray(ids)
        return (ids[ids >= self._offset] - self._offset).astype(np.uint8).tobytes()
