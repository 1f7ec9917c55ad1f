"""The attention kernels against the XLA reference path, and the TPU kernel compiled for a TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.errors import ConfigError
from jaxscale.parallel.context import load_balanced_order
from jaxscale.parallel.attention import attend, check_implementation, resolve
from jaxscale.parallel.mesh import build_mesh
from jaxscale.parallel.sharding import rules_from_config, use_rules
from jaxscale.config import default_config

RNG = np.random.default_rng(0)


def qkv(batch=2, length=256, heads=4, kv_heads=2, head_dim=64):
    q = jnp.asarray(RNG.standard_normal((batch, length, heads, head_dim)), jnp.float32)
    k = jnp.asarray(RNG.standard_normal((batch, length, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(RNG.standard_normal((batch, length, kv_heads, head_dim)), jnp.float32)
    # Row 0: two packed documents and padding (id 0); row 1: one document.
    segments = np.ones((batch, length), np.int32)
    segments[0, 100:] = 2
    segments[0, 250:] = 0
    return q, k, v, jnp.asarray(segments)


def loss_and_grads(implementation, q, k, v, segments):
    def loss(q, k, v):  # a non-linear read-out, so every output position matters
        return jnp.sum(jnp.sin(attend(q, k, v, segments, implementation, interpret=True)))
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def assert_close(got, want):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5), got, want)


def test_splash_equals_xla_with_packing_and_grouped_heads():
    """The Pallas kernel, run by its interpreter on CPU, gives the XLA path's outputs and
    gradients (causal, per-document masks, 2 query heads per KV head)."""
    q, k, v, segments = qkv()
    assert_close(attend(q, k, v, segments, "splash", interpret=True),
                 attend(q, k, v, segments, "xla"))
    assert_close(loss_and_grads("splash", q, k, v, segments),
                 loss_and_grads("xla", q, k, v, segments))


def test_splash_per_shard_equals_xla_on_a_sharded_mesh():
    """Inside shard_map over data x fsdp x tensor (batch rows and heads split), the kernel's result
    is the single-device XLA result."""
    config = default_config()
    mesh = build_mesh(dict(data=2, fsdp=2, tensor=2, pipeline=1),
                      dict(data=1, fsdp=1, tensor=1, pipeline=1), jax.devices()[:8])
    rules = rules_from_config(config.sharding.rules)
    q, k, v, segments = qkv(batch=4)
    want = loss_and_grads("xla", q, k, v, segments)
    with use_rules(mesh, rules):
        got = jax.jit(lambda *a: loss_and_grads("splash", *a))(q, k, v, segments)
    assert_close(got, want)


def test_a_split_sequence_in_any_order_attends_by_position():
    """With the length split over context=4 (x tensor=2) and the tokens in the load-balanced
    order, attention (keys and values all-gathered per shard, masked by positions and segments)
    gives the single-device result in that order, outputs and gradients; without positions the
    array indices are the positions."""
    config = default_config()
    mesh = build_mesh(dict(context=4, tensor=2), {}, jax.devices()[:8])
    rules = rules_from_config(config.sharding.rules)
    q, k, v, _ = qkv(length=64)
    # Row 0: documents of 30 and 30 tokens, then padding; row 1: one document. Positions restart
    # in each document, as packing makes them.
    index = np.arange(64)
    segments = jnp.asarray(np.stack([np.where(index < 30, 1, np.where(index < 60, 2, 0)),
                                     np.ones(64)]), jnp.int32)
    positions = jnp.asarray(np.stack([np.where(index < 30, index, index - 30), index]),
                            jnp.int32)
    order = load_balanced_order(64, 4)
    want = loss_and_grads("xla", q, k, v, segments)
    permuted = lambda x: x[:, order]

    def context_loss_and_grads(q, k, v, segments, positions):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(attend(q, k, v, segments, "auto", positions=positions)))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    with use_rules(mesh, rules):
        got = jax.jit(context_loss_and_grads)(*map(permuted, (q, k, v, segments, positions)))
        unordered = jax.jit(lambda *a: attend(*a, "xla"))(q, k, v, segments)
    assert_close(got, (want[0], tuple(map(permuted, want[1]))))
    assert_close(unordered, attend(q, k, v, segments, "xla"))


def test_auto_picks_the_kernel_from_the_mesh_devices():
    assert resolve("auto", 2048) == "xla"  # the CPU test machine
    assert resolve("xla", 2048) == "xla"

    class Tpu:
        platform = "tpu"

    class TpuMesh:
        devices = np.asarray([Tpu()])

    with use_rules(TpuMesh(), {}):
        assert resolve("auto", 2048) == "splash"
        assert resolve("auto", 100) == "xla"  # not a multiple of the kernel's 128-token tiles


def test_splash_where_it_cannot_run_is_a_config_error():
    with pytest.raises(ConfigError, match="TPU kernel and the devices are cpu"):
        check_implementation("splash", "cpu", 2048)
    with pytest.raises(ConfigError, match="multiple of 128"):
        check_implementation("splash", "tpu", 200)
    check_implementation("splash", "tpu", 2048)
    check_implementation("auto", "cpu", 200)
