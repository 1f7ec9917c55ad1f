"""The layer stack that writes each layer's gradient over its weights: the same values and
gradients as the plain scan, one stack-sized buffer fewer in the compiled backward pass; and the
stacks unrolled (`unroll`), the same values again."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.parallel.stack import scan_layers, scan_layers_overwriting_weights
from jaxscale.plan.targets import parse_target, target_devices

LAYERS, WIDTH = 4, 8


def layer_fn(state, carry, positions):
    """A layer with a weight in the compute dtype, a float32 scale, a frozen bias, an integer
    index (as LoRA dropout's stack has), a carry that is a pair (as MoE's is) and an integer
    per-row input; it saves nothing for its backward, as under remat "full"."""
    def run(state, carry, positions):
        x, total = carry
        h = jnp.tanh(jnp.einsum("bd,de->be", x.astype(jnp.bfloat16), state["w"],
                                preferred_element_type=jnp.float32))
        h = h * state["scale"] + state["bias"] + 0.01 * state["index"] + 0.001 * positions
        return h, total + jnp.sum(h * h)
    return jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)(
        state, carry, positions)


def inputs():
    rng = np.random.default_rng(0)
    trained = {"w": jnp.asarray(rng.normal(size=(LAYERS, WIDTH, WIDTH)) / 3, jnp.bfloat16),
               "scale": jnp.asarray(rng.normal(size=(LAYERS, WIDTH)), jnp.float32)}
    fixed = {"bias": jnp.asarray(rng.normal(size=(LAYERS, WIDTH)), jnp.float32),
             "index": jnp.arange(LAYERS, dtype=jnp.int32)[:, None]}
    x = jnp.asarray(rng.normal(size=(3, WIDTH)), jnp.float32)
    positions = jnp.arange(3, dtype=jnp.int32)[:, None]
    return trained, fixed, x, positions


@pytest.mark.parametrize("differentiate_x", [True, False])
def test_the_overwriting_stack_equals_the_plain_scan_in_values_and_gradients(differentiate_x):
    """Bit for bit: the output, the gradients of the trained leaves (bfloat16 and float32) and,
    when asked, of the input; the frozen and integer leaves and the per-row input get none."""
    trained, fixed, x, positions = inputs()

    def loss(stack, trained, x):
        y, total = stack(layer_fn, {**trained, **fixed}, (x, jnp.zeros((), jnp.float32)),
                         positions)
        return jnp.sum(y * jnp.arange(WIDTH)) + total

    argnums = (0, 1) if differentiate_x else (0,)
    results = [jax.jit(jax.value_and_grad(lambda t, x: loss(stack, t, x), argnums))(trained, x)
               for stack in (scan_layers, scan_layers_overwriting_weights)]
    jax.tree.map(np.testing.assert_array_equal, *results)
    _, grads = results[1]
    assert grads[0]["w"].dtype == jnp.bfloat16 and grads[0]["scale"].dtype == jnp.float32
    assert float(jnp.abs(grads[0]["w"].astype(jnp.float32)).max()) > 0


@pytest.mark.parametrize("overwriting", [False, True])
@pytest.mark.parametrize("unroll", [0, 2])
def test_an_unrolled_stack_equals_the_loop_in_values_and_gradients(overwriting, unroll):
    """Every layer unrolled (0), or two a turn: the output and every gradient (weights in
    bfloat16 and float32, the input) those of the loop over single layers, to float32 rounding;
    unrolled whole, the program has no loop left, and the plain stack builds the stacked
    gradients without writing them a layer at a time."""
    trained, fixed, x, positions = inputs()
    stack = scan_layers_overwriting_weights if overwriting else scan_layers

    def loss(unroll, trained, x):
        y, total = stack(layer_fn, {**trained, **fixed}, (x, jnp.zeros((), jnp.float32)),
                         positions, unroll=unroll)
        return jnp.sum(y * jnp.arange(WIDTH)) + total

    def value_and_grads(unroll):
        return jax.jit(jax.value_and_grad(functools.partial(loss, unroll), (0, 1)))(trained, x)

    want, got = value_and_grads(1), value_and_grads(unroll)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g, np.float32),
                                                         np.asarray(w, np.float32),
                                                         rtol=1e-6, atol=1e-6), got, want)
    hlo = jax.jit(jax.grad(functools.partial(loss, unroll), (0, 1))).lower(
        trained, x).compile().as_text()
    assert (" while(" in hlo) == (unroll != 0)
    if unroll == 0 and not overwriting:  # the overwriting stack writes gradients by design
        assert "dynamic-update-slice" not in hlo


def test_the_overwriting_stack_holds_the_weights_and_their_gradients_in_one_buffer():
    """Compiled for a TPU chip: differentiating a stack of float32 weights cast to bfloat16
    before the loop (as `weights_cast_for_use` casts them), the plain scan holds the cast copy
    and the stacked gradients (two stacks of bfloat16) at its peak; the overwriting one one.
    (measured: 137.5 and 105.5 MiB at the peak, the stack 32 MiB)."""
    layers, width, rows = 16, 1024, 256
    mesh = jax.sharding.Mesh(target_devices(parse_target("v5p:2x2x1"))[:1], ("x",))
    device = jax.sharding.NamedSharding(mesh, P())
    weights = jax.ShapeDtypeStruct((layers, width, width), jnp.float32, sharding=device)
    x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=device)
    stack_bytes = layers * width * width * 2  # one bfloat16 stack: 32 MiB

    def layer(w, x):
        return jax.checkpoint(lambda w, x: jnp.tanh(x @ w),
                              policy=jax.checkpoint_policies.nothing_saveable)(w, x)

    memory = {}
    for stack in (scan_layers, scan_layers_overwriting_weights):
        def grad_in_bfloat16(w, x, stack=stack):
            cast = w.astype(jnp.bfloat16)
            return jax.grad(lambda c: jnp.sum(stack(layer, c, x).astype(jnp.float32)))(cast)
        memory[stack] = jax.jit(grad_in_bfloat16).lower(weights, x).compile().memory_analysis()
    plain, overwriting = memory[scan_layers], memory[scan_layers_overwriting_weights]
    # The gradients are the output either way; the plain scan's temporaries add the cast copy.
    assert overwriting.temp_size_in_bytes < stack_bytes < plain.temp_size_in_bytes
    assert overwriting.peak_memory_in_bytes <= plain.peak_memory_in_bytes - 0.9 * stack_bytes
