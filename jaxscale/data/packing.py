"""Packing: many documents into fixed-length rows, with segment ids so they do not see each other.

A row holds `inputs`/`targets` (next-token pairs), `segment_ids` (1, 2, ... per document in the
row; 0 is padding), `positions` (restarting at 0 per document) and `loss_mask` (0 on padding).
Documents are shifted into (input, target) pairs *before* packing, so no target crosses from one
document into the next and nothing but padding needs masking.
"""

from __future__ import annotations

import functools

import grain
import jax
import jax.numpy as jnp
import numpy as np

# The features packed together; grain adds `<name>_segment_ids` and `<name>_positions` for each.
_PACKED = ("inputs", "targets")


def _framed_pairs(bos_id: int, eos_id: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
    document = np.concatenate([[bos_id], tokens, [eos_id]]).astype(np.int32)
    return {"inputs": document[:-1], "targets": document[1:]}


def next_token_pairs(documents: grain.MapDataset, bos_id: int, eos_id: int) -> grain.MapDataset:
    """Frames each token array as `bos + tokens + eos` and splits it into inputs and targets."""
    return documents.map(functools.partial(_framed_pairs, bos_id, eos_id))


def _row(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    segment_ids = packed["inputs_segment_ids"]
    return {
        "inputs": packed["inputs"],
        "targets": packed["targets"],
        "segment_ids": segment_ids,
        "positions": packed["inputs_positions"],
        "loss_mask": (segment_ids != 0).astype(np.float32),
    }


def concat_then_split(pairs: grain.IterDataset, seq_len: int) -> grain.IterDataset:
    """Concatenates documents and cuts the stream into rows of `seq_len`: no padding except at the
    very end of a finite stream; a document cut at a row's end continues, at position 0, in the
    next row."""
    packed = grain.experimental.ConcatThenSplitIterDataset(
        pairs, length_struct={name: seq_len for name in _PACKED})
    return packed.map(_row)


def attention_mask_from_segments(segment_ids: jax.Array) -> jax.Array:
    """bool[batch, q, k]: True where query q may attend to key k — causal and within q's segment.

    Padding (segment 0) attends to padding, so no query row is all False (a softmax over nothing).
    """
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    return same_segment & causal
