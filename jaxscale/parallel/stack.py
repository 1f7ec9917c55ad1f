"""Running a stack of layers: the layers' state stacked along a leading axis, one `lax.scan` over
it, so compile time does not grow with depth.

    x = scan_layers(layer_fn, stacked_state, x, *per_row)
    x = scan_layers_overwriting_weights(layer_fn, stacked_state, x, *per_row)   # remat "full"
    stack = functools.partial(scan_layers, unroll=0)   # every layer written out, no loop

`unroll` is `lax.scan`'s: k layers per turn of the loop, 0 all of them and no loop. Unrolled,
XLA sees each layer's slice of the stack as a constant slice and builds the stacked gradients and
saved activations by concatenation, where the loop writes them a layer at a time
(dynamic-update-slices, a tenth of llama_1b's step on one H200: benchmarks/RESULTS.md); compile
time grows with depth. The values are the same either way.

The second computes the same values and gradients (bit for bit) with less memory when the
layer function saves nothing for its backward pass (`jax.checkpoint` with `nothing_saveable`).
Its backward pass writes each layer's weight gradient over that layer's weights in the stack:
the stack is only read back a layer at a time in reverse, so once layer l's gradient is made its
weights are never read again. Plain autodiff of the scan instead keeps the stack (alive to the
end of the backward pass) and stacks the gradients in a second buffer of the same size. For
weights cast to the compute dtype before the loop (`weights_cast_for_use`), XLA then reuses the
cast copy's buffer for the gradient, a whole bfloat16 copy of the layers (benchmarks/memory.py's
figure in benchmarks/RESULTS.md; tests/test_stack.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

# A layer as a pure function: (its state, x, *per-row inputs) -> x.
LayerFn = Callable[..., jax.Array]
# Runs a stack of layers: (layer_fn, the state stacked along a leading layer axis, x, *per-row
# inputs) -> x after every layer in order. x is the activations, or with MoE layers the pytree
# (activations, router statistics) that `Decoder.features` carries through.
Stack = Callable[..., jax.Array]


def scan_layers(layer_fn: LayerFn, stacked_state, x: jax.Array, *per_row,
                unroll: int = 1) -> jax.Array:
    """The plain `Stack`: the layers one after another in a `lax.scan` (`unroll` layers a turn;
    0: all of them, no loop)."""
    def body(x, layer_state):
        return layer_fn(layer_state, x, *per_row), None
    return jax.lax.scan(body, x, stacked_state, unroll=unroll)[0]


def scan_layers_overwriting_weights(layer_fn: LayerFn, stacked_state, x: jax.Array,
                                    *per_row, unroll: int = 1) -> jax.Array:
    """`scan_layers`, whose backward pass recomputes each layer from its input and writes the
    layer's gradient over its weights (see the module's docstring). Meant for a `layer_fn` that
    saves nothing for its backward: with one that saves more, this would recompute what it
    saved. The per-row inputs (positions, segment ids, dropout keys) get no gradient. `unroll`
    applies to both passes' loops."""
    return _overwriting(layer_fn, unroll, stacked_state, x, per_row)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _overwriting(layer_fn, unroll, stacked_state, x, per_row):
    return scan_layers(layer_fn, stacked_state, x, *per_row, unroll=unroll)


def _overwriting_forward(layer_fn, unroll, stacked_state, x, per_row):
    # With symbolic zeros each argument comes wrapped, saying whether it is differentiated: a
    # frozen weight (LoRA's base) gets no gradient, so its matmuls are left out of the backward.
    trained = [p.perturbed and jnp.issubdtype(p.value.dtype, jnp.inexact)
               for p in jax.tree.leaves(stacked_state)]
    stacked_state, x, per_row = jax.tree.map(lambda p: p.value, (stacked_state, x, per_row))

    def body(x, layer_state):
        return layer_fn(layer_state, x, *per_row), x  # each layer's input, for the backward

    out, inputs = jax.lax.scan(body, x, stacked_state, unroll=unroll)
    return out, (stacked_state, inputs, per_row, trained)


def _overwriting_backward(layer_fn, unroll, residuals, grad_out):
    stacked_state, inputs, per_row, trained = residuals
    leaves, treedef = jax.tree.flatten(stacked_state)
    fixed_leaves = [a for a, t in zip(leaves, trained) if not t]
    grad_out = jax.tree.map(  # an output nothing depends on: its zeros, made
        lambda g, x: jnp.zeros(x.shape, x.dtype) if isinstance(g, SymbolicZero) else g,
        grad_out, jax.tree.map(lambda a: a[0], inputs),
        is_leaf=lambda g: isinstance(g, SymbolicZero))
    n = leaves[0].shape[0]

    def one_layer(i, carry):
        # In reverse: layers above l hold their gradients now, layer l and below their weights.
        grad_x, stack = carry
        l = n - 1 - i
        fixed = [a[l] for a in fixed_leaves]

        def layer(weights, x):
            weights, fixed_ = iter(weights), iter(fixed)
            state = jax.tree.unflatten(treedef, [next(weights) if t else next(fixed_)
                                                 for t in trained])
            return layer_fn(state, x, *per_row)

        _, vjp = jax.vjp(layer, [a[l] for a in stack], jax.tree.map(lambda a: a[l], inputs))
        grad_weights, grad_x = vjp(grad_x)
        return grad_x, [a.at[l].set(g.astype(a.dtype)) for a, g in zip(stack, grad_weights)]

    grad_x, grads = jax.lax.fori_loop(
        0, n, one_layer, (grad_out, [a for a, t in zip(leaves, trained) if t]),
        unroll=unroll or True)  # fori_loop's "every turn unrolled" is True, scan's 0
    grads = iter(grads)
    grad_state = jax.tree.unflatten(treedef, [next(grads) if t else None for t in trained])
    return grad_state, grad_x, jax.tree.map(lambda _: None, per_row)


_overwriting.defvjp(_overwriting_forward, _overwriting_backward, symbolic_zeros=True)
