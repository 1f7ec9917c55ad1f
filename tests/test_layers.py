"""The model's blocks against plain jax.numpy references written here, independently."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from jaxscale.config import default_config
from jaxscale.models.layers import (
    MLP,
    MLP_CHUNK,
    Attention,
    RMSNorm,
    apply_rope,
    embedding_lookup,
    fewest_parts,
    gathered,
    gathered_before,
    swiglu,
)
from jaxscale.models.lora import LoraConfig
from jaxscale.models.spec import create_model, model_config
from jaxscale.parallel.mesh import build_mesh
from jaxscale.parallel.sharding import rules_from_config, use_rules
from tests.helpers import small_config

RNG = np.random.default_rng(0)


def randn(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def reference_rope(x, positions, theta):
    """Rotary embedding written as complex rotation of (x[i], x[i + half]) pairs."""
    half = x.shape[-1] // 2
    freqs = theta ** (-np.arange(half) / half)
    angle = np.asarray(positions)[..., None, None] * freqs  # [b, t, 1, half]
    z = (np.asarray(x[..., :half]) + 1j * np.asarray(x[..., half:])) * np.exp(1j * angle)
    return np.concatenate([z.real, z.imag], axis=-1)


def reference_attention(x, wq, wk, wv, wo, positions, segment_ids, theta):
    """Causal GQA attention with explicit loops over heads and an explicit softmax."""
    x, wq, wk, wv, wo = (np.asarray(a, np.float64) for a in (x, wq, wk, wv, wo))
    q = reference_rope(np.einsum("btd,dnh->btnh", x, wq), positions, theta)
    k = reference_rope(np.einsum("btd,dkh->btkh", x, wk), positions, theta)
    v = np.einsum("btd,dkh->btkh", x, wv)
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    allowed = np.tril(np.ones((t, t), bool))[None] & (
        segment_ids[:, :, None] == segment_ids[:, None, :])
    for head in range(n):
        scores = q[:, :, head] @ k[:, :, head // group].transpose(0, 2, 1) / math.sqrt(h)
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, :, head] = probs @ v[:, :, head // group]
    return np.einsum("btnh,nhd->btd", out, wo)


def test_rmsnorm_matches_reference():
    norm = RMSNorm(8, eps=1e-5)
    norm.scale[...] = randn(8)
    x = randn(2, 3, 8)
    expected = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-5) * norm.scale[...]
    np.testing.assert_allclose(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_rope_matches_complex_rotation():
    x = randn(2, 5, 3, 8)
    positions = jnp.asarray(RNG.integers(0, 100, (2, 5)))
    np.testing.assert_allclose(apply_rope(x, positions, 10000.0),
                               reference_rope(x, positions, 10000.0), rtol=1e-4, atol=1e-4)


def test_rope_preserves_relative_position_scores():
    """q·k after rotation depends only on the distance between positions."""
    q, k = randn(1, 1, 1, 16), randn(1, 1, 1, 16)
    def score(i, j):
        return float(jnp.sum(apply_rope(q, jnp.array([[i]]), 1e4) *
                                           apply_rope(k, jnp.array([[j]]), 1e4)))
    assert score(3, 1) == pytest.approx(score(12, 10), rel=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_attention_matches_reference(n_heads, n_kv_heads):
    attn = Attention(16, n_heads, n_kv_heads, 8, rope_theta=1e4, out_stddev=0.02,
                     dtype=jnp.float32, implementation="xla", rngs=nnx.Rngs(0))
    for w in (attn.q, attn.k, attn.v, attn.o):
        w[...] = randn(*w.shape) * 0.3
    x = randn(2, 6, 16)
    positions = jnp.asarray([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    segments = np.asarray([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1]])
    got = attn(x, positions, jnp.asarray(segments))
    expected = reference_attention(x, attn.q[...], attn.k[...], attn.v[...], attn.o[...],
                                   positions, segments, 1e4)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_mlp_matches_reference():
    mlp = MLP(8, 12, out_stddev=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
    x = randn(2, 3, 8)
    def silu(z):
        return z / (1 + np.exp(-z))
    xn = np.asarray(x, np.float64)
    expected = (silu(xn @ mlp.gate[...]) * (xn @ mlp.up[...])) @ mlp.down[...]
    np.testing.assert_allclose(mlp(x), expected, rtol=1e-4, atol=1e-6)


def test_packed_documents_do_not_see_each_other():
    """A row holding two documents gives each the logits it gets alone (positions restart)."""
    model = create_model(model_config(small_config()), 0)
    a, b = RNG.integers(3, 259, 5), RNG.integers(3, 259, 7)
    packed = jnp.asarray(np.concatenate([a, b]))[None]
    positions = jnp.asarray(np.concatenate([np.arange(5), np.arange(7)]))[None]
    segments = jnp.asarray(np.array([1] * 5 + [2] * 7))[None]
    together = model(packed, positions, segments)
    np.testing.assert_allclose(together[0, :5], model(jnp.asarray(a)[None])[0], atol=2e-5)
    np.testing.assert_allclose(together[0, 5:], model(jnp.asarray(b)[None])[0], atol=2e-5)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_policies_keep_gradients(remat):
    config = small_config()
    tokens = jnp.asarray(RNG.integers(3, 259, (2, 8)))

    def grads(cfg):
        model = create_model(model_config(cfg), 0)
        graphdef, params = nnx.split(model)
        def loss(p):
            return jnp.sum(nnx.merge(graphdef, p)(tokens) ** 2)
        return jax.grad(loss)(params)

    baseline = grads(config)
    config.model.remat = remat
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grads(config), baseline)


@pytest.mark.parametrize("moe_every", [0, 1])
def test_save_dots_keeps_the_weight_matmuls_also_in_a_pipeline_stage(moe_every, capsys):
    """remat=save_dots keeps each block's weight-matmul outputs for the backward pass (full keeps
    none of them), for a block run alone and under the vmap over stages that a pipeline runs it
    in (which gives every matmul a batch dimension), dense and MoE (whose expert matmuls are
    batched over the experts anyway)."""
    def kept(remat: str, stages: bool) -> int:
        config = small_config()
        config.model.update(remat=remat, attention="xla")
        config.model.moe.update(every=moe_every, experts=4, top_k=2)
        model = create_model(model_config(config), 0)
        block_def, stacked = nnx.split(model.blocks)
        block = model.block_fn(block_def)
        length, d = 8, config.model.d_model
        positions = jnp.broadcast_to(jnp.arange(length), (2, length))
        def run(state, x):
            return block(state, x, positions, None)
        x = jnp.ones((2, length, d))
        if moe_every:
            from jaxscale.models.moe import RouterStats
            x = (x, RouterStats.zeros(4))
            def run(state, carry, run=run):
                return run(state, carry)[0]
        if stages:  # two stages, one layer each, as GPipe's vmap over the stage axis runs them
            run, state = jax.vmap(run), stacked
            x = jax.tree.map(lambda a: jnp.stack([a, a]), x)
        else:
            state = jax.tree.map(lambda a: a[0], stacked)
        print_saved_residuals(lambda s, x: jnp.sum(run(s, x)), state, x)
        return capsys.readouterr().out.count("named 'weight_matmul'")

    for stages in (False, True):
        assert kept("full", stages) == 0
        # q, k, v, the attention output's projection, and the feed-forward's gate and up (its
        # down projection's output feeds only the residual sum, whose backward needs no input);
        # with MoE the router's logits and the experts' gate, up and down (the combine's
        # backward needs the experts' outputs)
        assert kept("save_dots", stages) == (8 if moe_every else 6)


def test_embedding_lookup_equals_take_then_cast_in_values_and_gradients():
    """Gathered from the table cast first, the rows are the same; the table's gradient is
    autodiff's of take-then-cast (float32, repeated ids added up), bit for bit."""
    table = randn(50, 8)
    ids = jnp.asarray(RNG.integers(0, 50, (3, 40)))  # more ids than rows: repeats
    weights = randn(3, 40, 8)

    def loss(lookup, table):
        return jnp.sum(lookup(table).astype(jnp.float32) * weights)

    def plain(t):
        return jnp.take(t, ids, axis=0).astype(jnp.bfloat16)
    def ours(t):
        return embedding_lookup(t, ids, jnp.bfloat16)
    np.testing.assert_array_equal(ours(table), plain(table))
    got, want = (jax.grad(functools.partial(loss, f))(table) for f in (ours, plain))
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_equals_autodiffs_in_values_and_gradients(dtype):
    gate, up = randn(2, 5, 12).astype(dtype), randn(2, 5, 12).astype(dtype)
    grad = randn(2, 5, 12).astype(dtype)
    def plain(g, u):
        return jax.nn.silu(g) * u
    want, want_pullback = jax.vjp(plain, gate, up)
    got, got_pullback = jax.vjp(swiglu, gate, up)
    np.testing.assert_array_equal(got, want)
    jax.tree.map(np.testing.assert_array_equal, got_pullback(grad), want_pullback(grad))


def test_gathered_weights_are_the_weights_and_their_gradients_come_back_sharded():
    """On an fsdp x tensor mesh: `gathered` is the identity, its gradient autodiff's of the
    identity, laid out as the weight is; `gathered_before` likewise for both its arguments."""
    mesh = build_mesh(dict(fsdp=4, tensor=2, pipeline=1), dict(fsdp=1, tensor=1, pipeline=1),
                      jax.devices()[:8])
    weight, x = randn(16, 4, 6), randn(2, 3, 16)
    axes = ("embed", "heads", "head_dim")

    def loss(weight, x, gather):
        w, x = gather(weight, x)
        return jnp.sum(jnp.sin(jnp.einsum("btd,dnh->btnh", x, w)))

    with use_rules(mesh, rules_from_config(default_config().sharding.rules)):
        plain = jax.jit(jax.value_and_grad(functools.partial(loss, gather=lambda w, x: (w, x)),
                                           argnums=(0, 1)))(weight, x)
        for gather in (lambda w, x: (gathered(w, axes), x),
                       lambda w, x: gathered_before(axes, w, x)):
            got = jax.jit(jax.value_and_grad(functools.partial(loss, gather=gather),
                                             argnums=(0, 1)))(weight, x)
            # The same sums, partitioned differently: equal up to the order of addition.
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                         got, plain)
            assert got[1][0].sharding.is_equivalent_to(
                jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "tensor")),
                3)


def test_fewest_parts_divide_within_the_limit():
    assert fewest_parts(14336, MLP_CHUNK) == 2  # llama3_8b: 2 chunks of 7168
    assert fewest_parts(8192, MLP_CHUNK) == 1
    assert fewest_parts(28672, MLP_CHUNK) == 4
    assert fewest_parts(384, 100) == 4  # 96 each: 3 parts of 128 do not fit


@pytest.mark.parametrize("chunks", [2, 3])
def test_mlp_in_chunks_equals_the_whole_in_values_and_gradients(chunks):
    """Chunked (hidden units c, c + n, ... in 128-wide blocks; here 2 or 1 wide), the same sum
    and the same gradients as the whole MLP's, on one device and on an fsdp x tensor mesh."""
    whole = MLP(16, 24, out_stddev=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))
    chunked = MLP(16, 24, out_stddev=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0),
                  hidden_chunks=chunks)
    x = randn(4, 4, 16)

    def value_and_grads(mlp, x):
        graphdef, state = nnx.split(mlp)
        return jax.jit(jax.value_and_grad(
            lambda s, x: jnp.sum(jnp.sin(nnx.merge(graphdef, s)(x))), argnums=(0, 1)))(state, x)

    expected = value_and_grads(whole, x)
    mesh = build_mesh(dict(fsdp=4, tensor=2, pipeline=1), dict(fsdp=1, tensor=1, pipeline=1),
                      jax.devices()[:8])
    got = [value_and_grads(chunked, x)]
    with use_rules(mesh, rules_from_config(default_config().sharding.rules)):
        got.append(value_and_grads(chunked, x))
    for result in got:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     result, expected)


def test_mlp_runs_in_chunks_under_remat_full_only_and_without_fp8_or_adapters():
    config = small_config()
    config.model.mlp_dim = 256
    cfg = dataclasses.replace(model_config(config), mlp_chunk=128)
    assert cfg.remat != "full" and cfg.mlp_chunks == 1
    cfg = dataclasses.replace(cfg, remat="full")
    assert cfg.mlp_chunks == 2
    assert create_model(cfg, 0).blocks.mlp.hidden_chunks == 2
    assert dataclasses.replace(cfg, fp8_history=4).mlp_chunks == 1
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "up"))
    assert dataclasses.replace(cfg, lora=lora).mlp_chunks == 1
    assert dataclasses.replace(cfg, lora=dataclasses.replace(lora, targets=("q", "v"))
                               ).mlp_chunks == 2
    with pytest.raises(ValueError, match="hidden_chunks must be 1"):
        MLP(8, 16, 0.02, jnp.float32, nnx.Rngs(0), fp8_history=4, hidden_chunks=2)


def test_remat_full_in_mlp_chunks_keeps_gradients():
    """A model whose feed-forwards run in chunks (remat full) has the plain model's gradients."""
    config = small_config()
    config.model.mlp_dim = 512  # 2 chunks of 256: each 2 blocks of 128 hidden units
    tokens = jnp.asarray(RNG.integers(3, 259, (2, 8)))

    def grads(cfg):
        graphdef, params = nnx.split(create_model(cfg, 0))
        return jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens) ** 2))(params)

    plain = model_config(config)
    chunked = dataclasses.replace(plain, remat="full", mlp_chunk=256)
    assert chunked.mlp_chunks == 2
    # The same sums added in another order: gradients up to about 8 agree to 1e-5.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 grads(chunked), grads(plain))
