"""Next-token cross-entropy in float32, computed a slice of the sequence, and a tile of the
vocabulary, at a time.

The float32 logits of a whole batch are the largest arrays of a language model's step
([batch, length, vocab]: 2 GiB per device for Llama 3's 128256-token vocabulary at 2 x 2048
tokens), and autodiff keeps them, and their gradient, alive across the backward pass. Here the loss
scans over slices of the sequence; its backward pass recomputes one slice's logits at a time and
adds that slice's head gradient into an accumulator kept in the head's own (sharded) layout, so
neither the logits nor an unsharded head gradient ever exist whole. Same sum, added in another
order.

A large vocabulary is also split into tiles of at most `vocab_tile` entries: a slice's softmax is
made tile by tile (a running max and sum, the log-sum-exp kept per token for the backward pass),
and its gradient too, so a slice holds the logits of one tile, and the head gradient before its
reduction one tile's columns ([d, tile], not [d, vocab]: 1 GiB for Llama 3 in bfloat16). Tile t
holds the vocabulary ids t, t + n, t + 2n, ... (n tiles): the head [d, vocab] seen as
[d, vocab / n, n], so a vocabulary sharded in contiguous blocks (tensor parallelism) gives each
device its own part of every tile, and no tile is gathered across devices.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxscale.models.layers import fewest_parts
from jaxscale.parallel.sharding import constrain

# (features [..., d], head [d, v], vocab_ids=None) -> float32 logits [..., v]; `vocab_ids` [v]:
# the ids of the head's columns (None: 0 .. v - 1), whose padding the function masks.
LogitsFn = Callable[..., jax.Array]

def chunk_length(length: int, most: int) -> int:
    """The largest divisor of `length` that is at most `most` (0: the whole sequence)."""
    if most <= 0 or most >= length:
        return length
    return max(d for d in range(1, most + 1) if length % d == 0)


def vocab_tiles(vocab: int, most: int) -> int:
    """The fewest tiles, a divisor of `vocab`, that hold at most `most` entries each (1 when the
    whole vocabulary fits, or `most` is 0)."""
    return fewest_parts(vocab, most) if most > 0 else 1


def summed_cross_entropy(logits_fn: LogitsFn, head: jax.Array, head_axes: Sequence[str],
                         features: jax.Array, targets: jax.Array, mask: jax.Array,
                         chunk_len: int, vocab_tile: int) -> jax.Array:
    """Sum over tokens of `mask * -log softmax(logits_fn(features, head))[target]`, in float32.

    features [batch, length, d]; targets [batch, length] int; mask [batch, length] float; `head`
    the output weights, whose logical axes `head_axes` its gradient is kept in. At most
    `chunk_len` positions of every row, and at most `vocab_tile` entries of the vocabulary, have
    their logits in memory at once (0: all of them).
    """
    size = chunk_length(targets.shape[1], chunk_len)
    tiles = vocab_tiles(head.shape[1], vocab_tile)
    if size == targets.shape[1] and tiles == 1:
        return _slice_loss(logits_fn, head, features, targets, mask)
    return _chunked(logits_fn, tuple(head_axes), size, tiles, head, features, targets, mask)


def _slice_loss(logits_fn, head, features, targets, mask):
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits_fn(features, head),
                                                                 targets)
    return jnp.sum(token_loss * mask)


def _in_chunks(size, *arrays):
    """[batch, length, ...] -> [chunks, batch, size, ...] for each array."""
    def split(x):
        batch, length = x.shape[:2]
        x = jnp.swapaxes(x.reshape(batch, length // size, size, *x.shape[2:]), 0, 1)
        return constrain(x, (None, "batch", "length", "embed")[:x.ndim])
    return tuple(split(x) for x in arrays)


def _tile(head: jax.Array, tiles: int, t) -> tuple[jax.Array, jax.Array]:
    """(tile t of `head` [d, vocab / tiles], the vocabulary ids of its columns)."""
    d, vocab = head.shape
    columns = jax.lax.dynamic_index_in_dim(head.reshape(d, vocab // tiles, tiles), t, axis=2,
                                           keepdims=False)
    return columns, t + tiles * jnp.arange(vocab // tiles)


def _tiled_slice_loss(logits_fn, tiles, head, features, targets, mask):
    """(summed loss, log-sum-exp per token [batch, size]) of one slice, a vocabulary tile at a
    time: a running max and sum of exponentials, and the target's logit where its tile has it."""
    def add_tile(carry, t):
        high, total, target = carry
        columns, ids = _tile(head, tiles, t)
        logits = logits_fn(features, columns, vocab_ids=ids)
        new_high = jnp.maximum(high, jnp.max(logits, axis=-1))
        total = (total * jnp.exp(high - new_high)
                 + jnp.sum(jnp.exp(logits - new_high[..., None]), axis=-1))
        target = target + jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1)
        return (new_high, total, target), None

    # The lowest float32, not -inf: the first tile's rescale exp(high - new_high) stays 0, not NaN.
    start = jnp.full(targets.shape, jnp.finfo(jnp.float32).min)
    zeros = jnp.zeros(targets.shape, jnp.float32)
    (high, total, target), _ = jax.lax.scan(add_tile, (start, zeros, zeros), jnp.arange(tiles))
    lse = high + jnp.log(total)
    return jnp.sum((lse - target) * mask), lse


def _tiled_slice_gradients(logits_fn, head_axes, tiles, head_grad, head, features, targets, mask,
                           lse):
    """(head_grad plus this slice's head gradient, the slice's feature gradient), a tile at a
    time: d loss / d logits = (softmax - one-hot) * mask, from the forward pass's log-sum-exp."""
    d, vocab = head.shape
    tile_axes = (head_axes[0], head_axes[1], None)  # [d, vocab / tiles, tiles]

    def add_tile(carry, t):
        head_grad, feature_grad = carry
        columns, ids = _tile(head, tiles, t)
        logits, pullback = jax.vjp(lambda h, f: logits_fn(f, h, vocab_ids=ids), columns,
                                   features)
        grad_logits = (jnp.exp(logits - lse[..., None])
                       - (ids == targets[..., None])) * mask[..., None]
        grad_columns, grad_features = pullback(grad_logits)
        # Reduced into the head's layout tile by tile: never a [d, vocab] sum before the reduction.
        column = jax.lax.dynamic_index_in_dim(head_grad, t, axis=2, keepdims=False)
        head_grad = jax.lax.dynamic_update_index_in_dim(
            head_grad, column + grad_columns.astype(jnp.float32), t, axis=2)
        return (constrain(head_grad, tile_axes),
                feature_grad + grad_features.astype(jnp.float32)), None

    head_grad = constrain(head_grad.reshape(d, vocab // tiles, tiles), tile_axes)
    (head_grad, feature_grad), _ = jax.lax.scan(
        add_tile, (head_grad, jnp.zeros(features.shape, jnp.float32)), jnp.arange(tiles))
    return constrain(head_grad.reshape(d, vocab), head_axes), feature_grad


def _chunk_loss(logits_fn, tiles, head, features, targets, mask):
    """(summed loss of one slice, what its backward pass needs besides the inputs)."""
    if tiles == 1:
        return _slice_loss(logits_fn, head, features, targets, mask), None
    return _tiled_slice_loss(logits_fn, tiles, head, features, targets, mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _chunked(logits_fn, head_axes, size, tiles, head, features, targets, mask):
    return _chunked_forward(logits_fn, head_axes, size, tiles, head, features, targets, mask)[0]


def _chunked_forward(logits_fn, head_axes, size, tiles, head, features, targets, mask):
    def add_slice(total, chunk):
        loss, lse = _chunk_loss(logits_fn, tiles, head, *chunk)
        return total + loss, lse
    chunks = _in_chunks(size, features, targets, mask)
    total, lse = jax.lax.scan(add_slice, jnp.zeros((), jnp.float32), chunks)
    # No logits kept: the backward remakes them (with tiles, from the log-sum-exp per token).
    return total, (head, features, targets, mask, lse)


def _chunked_backward(logits_fn, head_axes, size, tiles, residuals, upstream):
    head, features, targets, mask, lse = residuals

    def add_slice_gradients(head_grad, chunk):
        slice_features, slice_targets, slice_mask, slice_lse = chunk
        if tiles > 1:
            return _tiled_slice_gradients(logits_fn, head_axes, tiles, head_grad, head,
                                          slice_features, slice_targets, slice_mask, slice_lse)
        grad_head, grad_features = jax.grad(
            lambda h, f: _slice_loss(logits_fn, h, f, slice_targets, slice_mask),
            argnums=(0, 1))(head, slice_features)
        # Reduced into the head's layout slice by slice (a reduce-scatter per slice under FSDP)
        # instead of one unsharded [d, vocab] float32 sum.
        return constrain(head_grad + grad_head, head_axes), grad_features

    zeros = constrain(jnp.zeros(head.shape, jnp.float32), head_axes)
    head_grad, feature_grads = jax.lax.scan(
        add_slice_gradients, zeros, (*_in_chunks(size, features, targets, mask), lse))
    feature_grads = jnp.swapaxes(feature_grads, 0, 1).reshape(features.shape)
    # The head's gradient is cast to the head's dtype before the features' gradient goes on
    # (the barrier ties the two): left alone, XLA casts it where the optimizer reads it, after
    # the layers' backward pass, holding the float32 accumulator through it, at the peak.
    return (*jax.lax.optimization_barrier(((head_grad * upstream).astype(head.dtype),
                                           (feature_grads * upstream).astype(features.dtype))),
            None, None)


_chunked.defvjp(_chunked_forward, _chunked_backward)
