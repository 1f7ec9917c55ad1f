"""Packing: many documents into fixed-length rows, with segment ids so they do not see each other.

A row holds `inputs`/`targets` (next-token pairs), `segment_ids` (1, 2, ... per document in the
row; 0 is padding), `positions` (restarting at 0 per document) and `loss_mask` (0 on padding).
Documents are shifted into (input, target) pairs *before* packing, so no target crosses from one
document into the next and nothing but padding needs masking — except in chat data, whose
documents say which tokens are learned (`TrainedTokens`); their mask is packed with them.
"""

from __future__ import annotations

from typing import NamedTuple

import grain
import numpy as np

METHODS = ("concat", "first_fit")
# data.packing's default: the method that suits the sources (`method_for`).
AUTO = "auto"
# The features packed together; grain adds `<name>_segment_ids` and `<name>_positions` for each.
_PACKED = ("inputs", "targets")
_MASKED = _PACKED + ("loss_mask",)


def method_for(packing: str, chat: bool) -> str:
    """The packing method `data.packing` asks for: "auto" is first_fit when some source is chat
    data (concat would cut conversations where rows end), else concat (no padding)."""
    if packing == AUTO:
        return "first_fit" if chat else "concat"
    return packing


class TrainedTokens(NamedTuple):
    """A framed document whose tokens are not all learned (chat data, jaxscale/data/chat.py):
    `learned[i]` says whether the loss falls on predicting `tokens[i]`."""

    tokens: np.ndarray  # int32[n], BOS/EOS included
    learned: np.ndarray  # bool[n]


class NextTokenPairs:
    """A document -> {"inputs", "targets"}, plus "loss_mask" when `masked`.

    Token ids are framed as `bos + ids + eos` (`bos_id`/`eos_id` of None frame nothing on that
    side) and every target is learned; a `TrainedTokens` comes framed, and pair j, which predicts
    token j + 1, is learned when that token is: its mask is `learned[1:]`. `masked` (some source
    is chat data) gives every document a mask, so that documents of all sources pack together.
    Passes None (a skipped record) through and turns documents too short to predict anything
    into None too.
    """

    def __init__(self, bos_id: int | None, eos_id: int | None, masked: bool = False):
        self._bos = [] if bos_id is None else [bos_id]
        self._eos = [] if eos_id is None else [eos_id]
        self._masked = masked

    def __call__(self, document: np.ndarray | TrainedTokens | None
                 ) -> dict[str, np.ndarray] | None:
        if isinstance(document, TrainedTokens):
            if len(document.tokens) < 2:
                return None
            return {"inputs": document.tokens[:-1], "targets": document.tokens[1:],
                    "loss_mask": document.learned[1:].astype(np.float32)}
        if document is None or len(document) + len(self._bos) + len(self._eos) < 2:
            return None
        tokens = np.concatenate([self._bos, document, self._eos]).astype(np.int32)
        pairs = {"inputs": tokens[:-1], "targets": tokens[1:]}
        if self._masked:
            pairs["loss_mask"] = np.ones(len(tokens) - 1, np.float32)
        return pairs


class _Chunks(grain.experimental.FlatMapTransform):
    """Cuts a document into pieces of at most `length` (first-fit needs every piece to fit)."""

    max_fan_out = 1  # only used by MapDataset flat maps; this one runs on an IterDataset

    def __init__(self, length: int):
        self._length = length

    def flat_map(self, pairs: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        n = len(pairs["inputs"])
        return [{k: v[start:start + self._length] for k, v in pairs.items()}
                for start in range(0, n, self._length)]


def _row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment_ids = packed["inputs_segment_ids"].astype(np.int32)
    # A packed mask is 0 on padding already: grain pads every feature with zeros.
    loss_mask = packed["loss_mask"] if "loss_mask" in packed else segment_ids != 0
    return {
        "inputs": packed["inputs"],
        "targets": packed["targets"],
        "segment_ids": segment_ids,
        "positions": packed["inputs_positions"].astype(np.int32),
        "loss_mask": loss_mask.astype(np.float32),
    }


def pack(pairs: grain.IterDataset, method: str, seq_len: int, rows_at_once: int,
         max_segments: int = 0, masked: bool = False) -> grain.IterDataset:
    """Packs next-token pairs into rows of `seq_len`.

    concat: concatenates documents and cuts the stream every `seq_len` tokens — no padding; a
      document cut at a row's end continues, from position 0, in the next row.
    first_fit: places whole documents (longer ones cut into `seq_len` pieces first) into the
      first of `rows_at_once` rows with room, and pads the rest — no document is split across
      rows unless it is longer than a row.

    `max_segments` > 0 bounds the runs per row (documents, and the padding as one more): a row
    with more is cut into rows of `max_segments - 1` documents each, padded. `masked`: the pairs
    carry their own "loss_mask" (see `NextTokenPairs`), packed with them.
    """
    lengths = {name: seq_len for name in (_MASKED if masked else _PACKED)}
    if method == "concat":
        packed = grain.experimental.ConcatThenSplitIterDataset(pairs, length_struct=lengths)
    else:
        pieces = grain.experimental.FlatMapIterDataset(pairs, _Chunks(seq_len))
        packed = grain.experimental.FirstFitPackIterDataset(
            pieces, length_struct=lengths, num_packing_bins=rows_at_once, shuffle_bins=False)
    rows = packed.map(_row)
    if max_segments:
        rows = grain.experimental.FlatMapIterDataset(rows, _AtMostSegments(max_segments))
    return rows


class _AtMostSegments(grain.experimental.FlatMapTransform):
    """Cuts a row with more than `limit` runs of one segment id into rows of `limit - 1` runs
    each (documents keep their tokens, positions and order; the rest is padding), so that every
    row fits a kernel that takes a fixed number of segments (cuDNN's packed layout)."""

    max_fan_out = 1  # grain reads it only for MapDataset flat maps; unbounded on an IterDataset

    def __init__(self, limit: int):
        self._limit = limit

    def flat_map(self, row: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        segment_ids = row["segment_ids"]
        starts = np.flatnonzero(np.diff(segment_ids, prepend=-1))
        if len(starts) <= self._limit:
            return [row]
        bounds = np.append(starts, len(segment_ids))
        documents = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if segment_ids[a] != 0]
        per_row = self._limit - 1
        return [_padded_row(row, documents[i:i + per_row])
                for i in range(0, len(documents), per_row)]


def _padded_row(row: dict[str, np.ndarray], documents: list[tuple[int, int]]
                ) -> dict[str, np.ndarray]:
    """A row of `row`'s `documents` ([start, end) runs), in order from index 0, then padding."""
    out = {key: np.zeros_like(values) for key, values in row.items()}
    at = 0
    for number, (start, end) in enumerate(documents, 1):
        for key, values in row.items():
            out[key][at:at + end - start] = number if key == "segment_ids" else values[start:end]
        at += end - start
    return out

