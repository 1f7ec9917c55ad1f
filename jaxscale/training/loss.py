"""Next-token cross-entropy in float32, computed a slice of the sequence at a time.

The float32 logits of a whole batch are the largest arrays of a language model's step
([batch, length, vocab]: 2 GiB per device for Llama 3's 128256-token vocabulary at 2 x 2048
tokens), and autodiff keeps them, and their gradient, alive across the backward pass. Here the loss
scans over slices of the sequence; its backward pass recomputes one slice's logits at a time and
adds that slice's head gradient into an accumulator kept in the head's own (sharded) layout, so
neither the logits nor an unsharded head gradient ever exist whole. Same sum, added in another
order.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxscale.parallel.sharding import constrain

LogitsFn = Callable[[jax.Array, jax.Array], jax.Array]  # (features [..., d], head) -> logits


def chunk_length(length: int, most: int) -> int:
    """The largest divisor of `length` that is at most `most` (0: the whole sequence)."""
    if most <= 0 or most >= length:
        return length
    return max(d for d in range(1, most + 1) if length % d == 0)


def summed_cross_entropy(logits_fn: LogitsFn, head: jax.Array, head_axes: Sequence[str],
                         features: jax.Array, targets: jax.Array, mask: jax.Array,
                         chunk_len: int) -> jax.Array:
    """Sum over tokens of `mask * -log softmax(logits_fn(features, head))[target]`, in float32.

    features [batch, length, d]; targets [batch, length] int; mask [batch, length] float; `head`
    the output weights, whose logical axes `head_axes` its gradient is kept in. At most
    `chunk_len` positions of every row have their logits in memory at once (0: all of them).
    """
    size = chunk_length(targets.shape[1], chunk_len)
    if size == targets.shape[1]:
        return _slice_loss(logits_fn, head, features, targets, mask)
    return _chunked(logits_fn, tuple(head_axes), size, head, features, targets, mask)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked(logits_fn, head_axes, size, head, features, targets, mask):
    def add_slice(total, chunk):
        return total + _slice_loss(logits_fn, head, *chunk), None
    total, _ = jax.lax.scan(add_slice, jnp.zeros((), jnp.float32),
                            _in_chunks(size, features, targets, mask))
    return total


def _chunked_forward(logits_fn, head_axes, size, head, features, targets, mask):
    total = _chunked(logits_fn, head_axes, size, head, features, targets, mask)
    return total, (head, features, targets, mask)  # no logits kept: the backward remakes them


def _chunked_backward(logits_fn, head_axes, size, residuals, upstream):
    head, features, targets, mask = residuals

    def add_slice_gradients(head_grad, chunk):
        slice_features, slice_targets, slice_mask = chunk
        grad_head, grad_features = jax.grad(
            lambda h, f: _slice_loss(logits_fn, h, f, slice_targets, slice_mask),
            argnums=(0, 1))(head, slice_features)
        # Reduced into the head's layout slice by slice (a reduce-scatter per slice under FSDP)
        # instead of one unsharded [d, vocab] float32 sum.
        return constrain(head_grad + grad_head, head_axes), grad_features

    zeros = constrain(jnp.zeros(head.shape, jnp.float32), head_axes)
    head_grad, feature_grads = jax.lax.scan(add_slice_gradients, zeros,
                                            _in_chunks(size, features, targets, mask))
    feature_grads = jnp.swapaxes(feature_grads, 0, 1).reshape(features.shape)
    return ((head_grad * upstream).astype(head.dtype),
            (feature_grads * upstream).astype(features.dtype), None, None)


_chunked.defvjp(_chunked_forward, _chunked_backward)
