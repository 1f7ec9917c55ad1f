"""The attention kernels against the XLA reference path, and the TPU kernel compiled for a TPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.config import default_config
from jaxscale.errors import ConfigError
from jaxscale.parallel.attention import (
    NO_WINDOW,
    _residuals_made_at_once,
    attend,
    check_attention,
    check_implementation,
    packed_segments,
    resolve,
    splash_mask,
)
from jaxscale.parallel.context import load_balanced_order
from jaxscale.parallel.mesh import build_mesh
from jaxscale.parallel.sharding import rules_from_config, use_rules

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
    def permuted(x):
        return x[:, order]

    def context_loss_and_grads(q, k, v, segments, positions):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(attend(q, k, v, segments, "auto", positions=positions)))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    with use_rules(mesh, rules):
        got = jax.jit(context_loss_and_grads)(*map(permuted, (q, k, v, segments, positions)))
        unordered = jax.jit(lambda *a: attend(*a, "xla"))(q, k, v, segments)
    assert_close(got, (want[0], tuple(map(permuted, want[1]))))
    assert_close(unordered, attend(q, k, v, segments, "xla"))


class FakeDevice:
    def __init__(self, platform, compute_capability="9.0"):
        self.platform, self.compute_capability = platform, compute_capability


class FakeMesh:
    def __init__(self, device, shape=None):
        self.devices, self.shape = np.asarray([device]), shape or {}


def test_auto_picks_the_kernel_from_the_mesh_devices():
    bf16 = jax.ShapeDtypeStruct((2, 2048, 8, 128), jnp.bfloat16)
    assert resolve("auto", bf16, packed=True, max_segments=32) == "xla"  # the CPU test machine
    assert resolve("xla", bf16, packed=True) == "xla"
    with use_rules(FakeMesh(FakeDevice("tpu")), {}):
        assert resolve("auto", bf16, packed=True) == "splash"
        # not a multiple of the kernel's 128-token tiles
        assert resolve("auto", jax.ShapeDtypeStruct((2, 100, 8, 128), jnp.bfloat16),
                       packed=True) == "xla"
    with use_rules(FakeMesh(FakeDevice("gpu")), {}):
        assert resolve("auto", bf16, packed=True, max_segments=32) == "cudnn"
        assert resolve("auto", bf16, packed=False) == "cudnn"
        assert resolve("auto", bf16, packed=True, max_segments=0) == "cudnn"  # the mask form
        # float32, a head too wide for the kernel, an odd length with the document mask
        assert resolve("auto", jax.ShapeDtypeStruct((2, 2048, 8, 128), jnp.float32),
                       packed=False) == "xla"
        assert resolve("auto", jax.ShapeDtypeStruct((2, 2048, 8, 264), jnp.bfloat16),
                       packed=False) == "xla"
        assert resolve("auto", jax.ShapeDtypeStruct((2, 2047, 8, 128), jnp.bfloat16),
                       packed=True) == "xla"
        # an odd length is fine in the packed layout, which builds no mask
        assert resolve("auto", jax.ShapeDtypeStruct((2, 2047, 8, 128), jnp.bfloat16),
                       packed=True, max_segments=8) == "cudnn"
    # An A100 has no packed layout: packed rows take the mask form, and heads up to 128.
    with use_rules(FakeMesh(FakeDevice("gpu", "8.0")), {}):
        assert resolve("auto", bf16, packed=True, max_segments=32) == "cudnn"
        assert resolve("auto", jax.ShapeDtypeStruct((2, 2048, 8, 192), jnp.bfloat16),
                       packed=True) == "xla"
    # A GPU that reports no CUDA compute capability (ROCm reports its gfx name) is no NVIDIA GPU.
    with use_rules(FakeMesh(FakeDevice("gpu", "gfx942")), {}):
        assert resolve("auto", bf16, packed=True, max_segments=32) == "xla"
    # The length split over a context axis: splash needs whole rows, cuDNN takes the mask form;
    # inside pipeline stages (their vmap) cuDNN cannot run.
    rules = rules_from_config(default_config().sharding.rules)
    for device, shape, kernel in ((FakeDevice("tpu"), dict(context=2), "xla"),
                                  (FakeDevice("gpu", "8.0"), dict(context=2), "cudnn"),
                                  (FakeDevice("gpu"), dict(pipeline=2), "xla")):
        with use_rules(FakeMesh(device, dict(dict(context=1, pipeline=1, tensor=1), **shape)),
                       rules):
            assert resolve("auto", bf16, packed=True, max_segments=32) == kernel


def test_a_kernel_where_it_cannot_run_is_a_config_error():
    cpu, tpu, a100 = FakeDevice("cpu"), FakeDevice("tpu"), FakeDevice("gpu", "8.0")
    with pytest.raises(ConfigError, match="TPU kernel and the devices are cpu"):
        check_implementation("splash", cpu, 2048, "bfloat16", 128, 32)
    with pytest.raises(ConfigError, match="multiple of 128"):
        check_implementation("splash", tpu, 200, "bfloat16", 128, 32)
    with pytest.raises(ConfigError, match="NVIDIA GPU kernel and the devices are tpu"):
        check_implementation("cudnn", tpu, 2048, "bfloat16", 128, 32)
    with pytest.raises(ConfigError, match="not float32 \\(precision.compute_dtype\\)"):
        check_implementation("cudnn", FakeDevice("gpu"), 2048, "float32", 128, 32)
    with pytest.raises(ConfigError, match="even train.seq_len, not 2047"):
        check_implementation("cudnn", FakeDevice("gpu"), 2047, "bfloat16", 128, 0)
    with pytest.raises(ConfigError, match="at most 128, not 256"):
        check_implementation("cudnn", a100, 2048, "bfloat16", 256, 32)
    with pytest.raises(ConfigError, match="devices are gpu with compute capability 'gfx942'"):
        check_implementation("cudnn", FakeDevice("gpu", "gfx942"), 2048, "bfloat16", 128, 0)
    check_implementation("cudnn", a100, 2048, "bfloat16", 128, 32)  # the mask form
    check_implementation("cudnn", FakeDevice("gpu"), 2047, "bfloat16", 256, 32)  # packed
    check_implementation("splash", tpu, 2048, "bfloat16", 128, 32)
    check_implementation("cudnn", FakeDevice("gpu"), 2048, "float16", 128, 32)
    check_implementation("auto", cpu, 200, "float32", 100, 0)


def test_packed_segments_describe_the_same_mask_as_the_segment_ids():
    """cuDNN's packed layout (run lengths and offsets) of random packed rows: rebuilt into a
    [q, k] mask, it is exactly "same segment id"; unused slots are -1."""
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(6):
        lengths = rng.integers(1, 12, size=rng.integers(1, 7))
        ids = np.repeat(np.arange(1, len(lengths) + 1), lengths)[:48]
        rows.append(np.pad(ids, (0, 48 - len(ids))))  # padding (0) is a run too
    segments = np.stack(rows).astype(np.int32)
    max_segments = 8
    lengths, offsets = jax.jit(packed_segments, static_argnums=1)(jnp.asarray(segments),
                                                                   max_segments)
    assert lengths.shape == (6, max_segments) and offsets.shape == (6, max_segments + 1)
    for row, row_lengths, row_offsets in zip(segments, np.asarray(lengths), np.asarray(offsets)):
        runs = np.flatnonzero(np.diff(row, prepend=-1))
        np.testing.assert_array_equal(row_offsets[:len(runs)], runs)
        assert (row_offsets[len(runs):] == -1).all() and (row_lengths[len(runs):] == -1).all()
        run_of = np.zeros(48, int)
        for number, (start, length) in enumerate(zip(row_offsets, row_lengths)):
            if length > 0:
                run_of[start:start + length] = number + 1
        assert (run_of > 0).all()  # every token is in some run
        np.testing.assert_array_equal(run_of[:, None] == run_of[None, :],
                                      row[:, None] == row[None, :])


def test_packed_segments_at_and_over_the_bound():
    """Rows of exactly M runs (with and without padding) are whole; a row of more lists only
    its first M runs (the (M+1)-th start is no offset: cuDNN lays the rows' segments end to end,
    so a stray offset would shift every later row's), and its neighbours are untouched."""
    segments = jnp.asarray([[1, 2, 3, 4, 5, 5, 5, 0],   # 6 runs: over M = 4
                            [1, 1, 1, 1, 2, 2, 0, 0],   # 3 runs
                            [1, 1, 2, 2, 3, 3, 4, 4],   # exactly 4, no padding
                            [1, 2, 2, 2, 3, 3, 0, 0]],  # exactly 4 with the padding
                           jnp.int32)
    lengths, offsets = packed_segments(segments, 4)
    np.testing.assert_array_equal(lengths, [[1, 1, 1, 1], [4, 2, 2, -1], [2, 2, 2, 2],
                                            [1, 3, 2, 2]])
    np.testing.assert_array_equal(offsets, [[0, 1, 2, 3, -1], [0, 4, 6, -1, -1],
                                            [0, 2, 4, 6, -1], [0, 1, 4, 6, -1]])
    # As many offsets as lengths in every row, so each row's segments stay its own.
    np.testing.assert_array_equal((offsets[:, :-1] >= 0), (lengths >= 0))


def test_residuals_made_at_once_are_autodiffs_bit_for_bit():
    """The wrapper that makes the splash kernel's residuals before its output is used changes no
    value: a function with residuals of its own (and an integer argument) gives autodiff's
    outputs and gradients exactly."""
    a, b = jnp.asarray(RNG.standard_normal((3, 4)), jnp.float32), jnp.asarray(
        RNG.standard_normal((4, 5)), jnp.float32)
    ids = jnp.arange(3)

    def f(a, b, ids):
        return jnp.tanh(a @ b) * jnp.exp(a[:, :1]) + ids[:, None]

    def loss(g, a, b):
        return jnp.sum(jnp.sin(g(a, b, ids)))

    want = jax.value_and_grad(lambda a, b: loss(f, a, b), argnums=(0, 1))(a, b)
    got = jax.value_and_grad(
        lambda a, b: loss(lambda *x: _residuals_made_at_once(f, *x), a, b), argnums=(0, 1))(a, b)
    jax.tree.map(np.testing.assert_array_equal, got, want)


def windowed_reference(q, k, v, segments, positions, window):
    """Attention written out in float64: a query sees the keys of its segment at its position or
    up to `window` - 1 before it."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    segments, positions = np.asarray(segments), np.asarray(positions)
    behind = positions[:, :, None] - positions[:, None, :]
    visible = (segments[:, :, None] == segments[:, None, :]) & (behind >= 0) & (behind < window)
    scores = np.where(visible[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(-1, keepdims=True), v)


def test_a_sliding_window_hides_the_keys_before_it_whole_or_split_over_context():
    """XLA's path, and the context path with the tokens in the load-balanced order, each equal
    attention written out with the window's mask, on packed rows whose documents are longer
    than the window; without the window the outputs differ."""
    q, k, v, _ = qkv(length=64, head_dim=16)
    index = np.arange(64)
    segments = np.stack([np.where(index < 30, 1, np.where(index < 60, 2, 0)), np.ones(64)])
    positions = np.stack([np.where(index < 30, index, index - 30), index])
    segments, positions = (jnp.asarray(x, jnp.int32) for x in (segments, positions))
    want = windowed_reference(q, k, v, segments, positions, window=8)
    got = attend(q, k, v, segments, "auto", window=8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(np.asarray(attend(q, k, v, segments, "xla")) - want).max() > 0.1

    mesh = build_mesh(dict(context=4, tensor=2), {}, jax.devices()[:8])
    order = load_balanced_order(64, 4)
    permuted = [x[:, order] for x in (q, k, v, segments, positions)]
    with use_rules(mesh, rules_from_config(default_config().sharding.rules)):
        split = jax.jit(lambda q, k, v, s, p: attend(q, k, v, s, "auto", positions=p,
                                                     window=8))(*permuted)
    np.testing.assert_allclose(split, want[:, order], rtol=0, atol=1e-5)


def test_a_window_per_layer_is_a_scanned_input_whole_or_split_over_context():
    """A window that applies to some layers only (Gemma 3's local and global ones) comes with a
    traced `local`, a scan's input: layer 0's window of 8 and layer 1's none each equal attention
    written out with its mask, in XLA's path and in the context path."""
    q, k, v, _ = qkv(length=64, head_dim=16)
    index = np.arange(64)
    segments = jnp.asarray(np.stack([np.where(index < 40, 1, 2), np.ones(64)]), jnp.int32)
    positions = jnp.asarray(np.stack([np.where(index < 40, index, index - 40), index]), jnp.int32)
    local = jnp.asarray([True, False])
    want = [windowed_reference(q, k, v, segments, positions, window=w) for w in (8, NO_WINDOW)]
    assert np.abs(want[0] - want[1]).max() > 0.1

    def per_layer(q, k, v, segments, positions=None):
        return jax.lax.map(lambda is_local: attend(q, k, v, segments, "auto", positions=positions,
                                                   window=8, local=is_local), local)
    got = jax.jit(per_layer)(q, k, v, segments)
    for layer in range(2):
        np.testing.assert_allclose(got[layer], want[layer], rtol=0, atol=1e-5)

    mesh = build_mesh(dict(context=4, tensor=2), {}, jax.devices()[:8])
    order = load_balanced_order(64, 4)
    permuted = [x[:, order] for x in (q, k, v, segments, positions)]
    with use_rules(mesh, rules_from_config(default_config().sharding.rules)):
        split = jax.jit(per_layer)(*permuted)
    for layer in range(2):
        np.testing.assert_allclose(split[layer], want[layer][:, order], rtol=0, atol=1e-5)


def test_a_window_in_every_layer_or_some_is_taken_by_the_kernels():
    """Mistral's window and Gemma 3's (on some layers only) are accepted by splash and cuDNN,
    where both were refused."""
    config = default_config()
    config.model.update(sliding_window=4096, head_dim=128)
    config.precision.compute_dtype = "bfloat16"
    for kernel, device in (("splash", FakeDevice("tpu")), ("cudnn", FakeDevice("gpu"))):
        for every in (0, 6):
            config.model.update(attention=kernel, global_every=every)
            check_attention(config, device)


def test_splashs_local_mask_is_the_window_of_the_reference():
    """The mask splash is given, read densely, is exactly "key at the query or up to window - 1
    before it" for a window, and causal without one."""
    index = np.arange(256)
    behind = index[:, None] - index[None, :]
    for window, want in ((40, (behind >= 0) & (behind < 40)), (0, behind >= 0)):
        mask = splash_mask(256, 2, window)
        assert mask.shape == (2, 256, 256)
        np.testing.assert_array_equal(np.asarray(mask[1, :, :]), want)


@pytest.mark.slow  # interpreted splash, forward and backward (about 11 s)
def test_splash_with_a_window_equals_the_windowed_reference():
    """The kernel, run by its interpreter, with a window of 40 on packed rows: its outputs are
    attention written out with the window's mask and its gradients XLA's; per layer (`local`
    traced, a scan's input) the windowed and the whole kernel each run where they should, their
    gradients XLA's."""
    q, k, v, segments = qkv(batch=1, head_dim=16)
    positions = jnp.broadcast_to(jnp.arange(256), segments.shape)
    want = windowed_reference(q, k, v, segments, positions, window=40)
    np.testing.assert_allclose(attend(q, k, v, segments, "splash", window=40, interpret=True),
                               want, rtol=0, atol=1e-5)
    whole = windowed_reference(q, k, v, segments, positions, window=NO_WINDOW)
    assert np.abs(want - whole).max() > 0.1

    def loss(implementation, q, k, v):
        out = attend(q, k, v, segments, implementation, window=40, interpret=True)
        return jnp.sum(jnp.sin(out))
    assert_close(jax.grad(functools.partial(loss, "splash"), argnums=(0, 1, 2))(q, k, v),
                 jax.grad(functools.partial(loss, "xla"), argnums=(0, 1, 2))(q, k, v))

    def per_layer(implementation, q, k, v):
        return jax.lax.map(lambda is_local: attend(q, k, v, segments, implementation, window=40,
                                                   local=is_local, interpret=True),
                           jnp.asarray([True, False]))
    got = jax.jit(functools.partial(per_layer, "splash"))(q, k, v)
    np.testing.assert_allclose(got[0], want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[1], whole, rtol=0, atol=1e-5)

    def layers_loss(implementation, q, k, v):
        return jnp.sum(jnp.sin(per_layer(implementation, q, k, v)))
    assert_close(jax.jit(jax.grad(functools.partial(layers_loss, "splash"), argnums=(0, 1, 2)))(
        q, k, v), jax.grad(functools.partial(layers_loss, "xla"), argnums=(0, 1, 2))(q, k, v))
