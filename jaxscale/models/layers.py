"""Transformer building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Parameters are stored in float32 and cast to the compute dtype where they are used. Every parameter
and activation is annotated with logical axis names only; the trainer's rules decide the mesh axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.parallel.sharding import constrain


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...],
          stddev: float) -> nnx.Param:
    """A float32 normal-initialised parameter annotated with logical axis names."""
    init = jax.nn.initializers.normal(stddev)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...]).astype(x.dtype)


def float32_accumulating(dtype: jnp.dtype) -> jnp.dtype:
    """The input dtype for a product that must accumulate in float32 (attention, logits).

    XLA:CPU has no float16 x float16 -> float32 dot, so there float16 inputs are widened; GPUs,
    the real home of float16 training, keep them.
    """
    if dtype == jnp.float16 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding ("rotate half" layout) on x: [batch, length, heads, head_dim]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, length, half]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def attention_mask(segment_ids: jax.Array | None) -> jax.Array | None:
    """[batch, 1, q, k] mask letting a token see only tokens of its own document (segment).

    Causality is applied separately (`is_causal`), so without packing there is no mask at all and
    GPUs can take the fused cuDNN kernel.
    """
    if segment_ids is None:
        return None
    return (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope_theta: float, out_stddev: float, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.q = param(rngs, (d_model, n_heads, head_dim), ("embed", "heads", "head_dim"), 0.02)
        self.k = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                       0.02)
        self.v = param(rngs, (d_model, n_kv_heads, head_dim), ("embed", "kv_heads", "head_dim"),
                       0.02)
        self.o = param(rngs, (n_heads, head_dim, d_model), ("heads", "head_dim", "embed"),
                       out_stddev)
        self.rope_theta = rope_theta
        self.dtype = dtype

    def __call__(self, x: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array | None) -> jax.Array:
        dt = self.dtype
        q = jnp.einsum("btd,dnh->btnh", x, self.q[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x, self.k[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x, self.v[...].astype(dt))
        q = constrain(apply_rope(q, positions, self.rope_theta),
                      ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, self.rope_theta),
                      ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        wide = float32_accumulating(dt)
        out = jax.nn.dot_product_attention(q.astype(wide), k.astype(wide), v.astype(wide),
                                           mask=attention_mask(segment_ids), is_causal=True)
        return jnp.einsum("btnh,nhd->btd", out.astype(dt), self.o[...].astype(dt))


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, mlp_dim: int, out_stddev: float, dtype: jnp.dtype,
                 rngs: nnx.Rngs):
        self.gate = param(rngs, (d_model, mlp_dim), ("embed", "mlp"), 0.02)
        self.up = param(rngs, (d_model, mlp_dim), ("embed", "mlp"), 0.02)
        self.down = param(rngs, (mlp_dim, d_model), ("mlp", "embed"), out_stddev)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        hidden = jax.nn.silu(x @ self.gate[...].astype(dt)) * (x @ self.up[...].astype(dt))
        hidden = constrain(hidden, ("batch", "length", "mlp"))
        return hidden @ self.down[...].astype(dt)
