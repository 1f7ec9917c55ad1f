"""Transformer building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP;
the KV cache that attention decodes with, one token at a time.

Parameters are stored in float32 and cast to the compute dtype where they are used. Every parameter
and activation is annotated with logical axis names only; the trainer's rules decide the mesh axes.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxscale.models.fp8 import Fp8Site, fp8_matmul, site
from jaxscale.models.lora import Adapter, AdapterDropout, LoraConfig, adapter
from jaxscale.models.rope import RopeScaling, apply_rope
from jaxscale.parallel.attention import attend
from jaxscale.parallel.sharding import constrain

# Parameters are created unsharded and placed by the trainer's jit out_shardings; Flax's eager
# sharding would need a mesh at construction time, which model code must not know about.
nnx.use_eager_sharding(False)

# The name of every weight matmul's output in a block: what remat "save_dots" keeps. Named rather
# than recognised by shape (a dot without batch dimensions): a pipeline stage's vmap gives every
# dot a batch dimension, and the experts' matmuls have one anyway.
WEIGHT_MATMUL = "weight_matmul"
# The most hidden units of a dense feed-forward whose activations and gathered weights a layer's
# backward pass holds at once under remat `full` (`MLP`'s hidden_chunks): llama3_8b's 14336 are
# 2 chunks, llama_1b's 8192 one.
MLP_CHUNK = 8192


def fewest_parts(size: int, most: int) -> int:
    """The fewest parts, a divisor of `size`, of at most `most` each (1 when `size` fits)."""
    return next(n for n in range(1, size + 1) if size % n == 0 and size // n <= most)


def weight_matmul(spec: str, x: jax.Array, weight: jax.Array,
                  out_dtype: jnp.dtype | None = None, fp8: Fp8Site | None = None) -> jax.Array:
    """`jnp.einsum(spec, x, weight)` with the weight cast to x's dtype (the compute dtype), its
    output in `out_dtype` (default x's) and named for the remat policies. With an `fp8` site the
    product is fp8 instead, scaled by the site's meta (`jaxscale.models.fp8.fp8_matmul`), its
    gradients made in the same dtypes.

    The weight's gradient is made in the dtype `weight` comes in, x's in x's dtype. Under data
    parallelism each device's weight gradient is a partial sum over its own rows, which XLA adds
    up across the data axes after the matmul that makes it, in that matmul's output dtype: the
    dtype the caller passes the weight in is the dtype its gradient crosses the wire in
    (`precision.grad_reduce_dtype`). Plain autodiff of a cast-then-einsum would make and reduce
    it in the compute dtype whatever the master's.
    """
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if fp8 is not None:
        out = fp8_matmul(spec, jnp.dtype(x.dtype), jnp.dtype(weight.dtype), out_dtype, x, weight,
                         fp8.values())
    else:
        out = _matmul(spec, jnp.dtype(weight.dtype), out_dtype, x, weight)
    return checkpoint_name(out, WEIGHT_MATMUL)


def adapted_matmul(spec: str, x: jax.Array, weight: jax.Array, fp8: Fp8Site | None,
                   lora: Adapter | None, dropout: AdapterDropout | None = None) -> jax.Array:
    """`weight_matmul`, plus the LoRA adapter's low-rank product when the weight has one
    (jaxscale/models/lora.py), its input through `dropout` when training with it; `weight`
    comes in the dtype its gradient is made in."""
    out = weight_matmul(spec, x, weight, fp8=fp8)
    if lora is None:
        return out
    return out + lora(spec, x, weight_matmul, weight.dtype, dropout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _matmul(spec, grad_dtype, out_dtype, x, weight):
    return jnp.einsum(spec, x, weight.astype(x.dtype), preferred_element_type=out_dtype)


def _matmul_forward(spec, grad_dtype, out_dtype, x, weight):
    # The residuals are plain autodiff's: x and the weight already cast (under FSDP, gathered).
    return _matmul(spec, grad_dtype, out_dtype, x, weight), (x, weight.astype(x.dtype))


def _matmul_backward(spec, grad_dtype, out_dtype, residuals, grad):
    x, compute_weight = residuals
    # An output made wider than the compute dtype (the float32 logits) has its gradient rounded
    # to the compute dtype for the two products, as PyTorch's autocast does: in float32 they
    # were a GPU's TF32 GEMMs, at half the bfloat16 rate, on operands twice the size (a
    # twentieth of llama_1b's step on one H200: benchmarks/RESULTS.md). TPUs round float32
    # operands to bfloat16 by default.
    grad = grad.astype(x.dtype)
    x_axes, rest = spec.split(",")
    weight_axes, out_axes = rest.split("->")
    grad_x = jnp.einsum(f"{out_axes},{weight_axes}->{x_axes}", grad, compute_weight,
                        preferred_element_type=out_dtype).astype(x.dtype)
    # preferred_element_type makes the partial sums, so the all-reduce or reduce-scatter after
    # them, grad_dtype. Operands are widened only where XLA:CPU lacks the float16 product.
    grad_weight = jnp.einsum(f"{x_axes},{out_axes}->{weight_axes}",
                             x.astype(float32_accumulating(x.dtype)),
                             grad.astype(float32_accumulating(grad.dtype)),
                             preferred_element_type=grad_dtype)
    return grad_x, grad_weight


_matmul.defvjp(_matmul_forward, _matmul_backward)


def gathered(weight: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`weight` (logical axes `axes`) with its `embed` dimension whole on every device: under
    FSDP, the weight gathered here rather than where the partitioner finds a matmul needing it
    whole. Its gradient is reduced back into `axes`' layout (a reduce-scatter, as the implicit
    gather's is), not summed whole on every device.

    The same collectives either way; what changes is that XLA sees one gathered value. With the
    attention weights gathered implicitly, the TPU compiler (v5p-64, llama3_8b) ran their
    gathers twice in the backward pass of a layer once the splash residuals were made early
    (`jaxscale.parallel.attention`): more all-reduce every layer (benchmarks/RESULTS.md)."""
    return _gathered(axes, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gathered(axes, weight):
    return constrain(weight, tuple(None if a == "embed" else a for a in axes))


def _gathered_forward(axes, weight):
    return _gathered(axes, weight), None


def _gathered_backward(axes, _, grad):
    return (constrain(grad, axes),)


_gathered.defvjp(_gathered_forward, _gathered_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gathered_before(axes: tuple[str, ...], weight: jax.Array,
                    x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(`gathered(weight, axes)`, `x`), the gather made before anything that uses the `x`
    returned: an order, the same values and gradients."""
    return jax.lax.optimization_barrier((gathered(weight, axes), x))


def _gathered_before_forward(axes, weight, x):
    return gathered_before(axes, weight, x), None


def _gathered_before_backward(axes, _, grads):
    grad_weight, grad_x = grads  # no order imposed on the gradients
    return constrain(grad_weight, axes), grad_x


gathered_before.defvjp(_gathered_before_forward, _gathered_before_backward)


# A gated feed-forward's activations by name: SwiGLU's silu, GeGLU's gelu with the tanh
# approximation (Gemma's `gelu_pytorch_tanh`).
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def swiglu(gate: jax.Array, up: jax.Array, activation: str = "silu") -> jax.Array:
    """`act(gate) * up` (`activation` a key of ACTIVATIONS: silu, SwiGLU, by default), with
    autodiff's gradients, each made whole in the backward pass.

    Left to autodiff, XLA folds the activation's derivative into the matmuls that read the two
    gradients, so `gate` itself stays alive until the last of them (the feed-forward's weight
    gradients, at the end of a layer's backward pass); made here, both gradients can take the
    place of their inputs. With `MLP`'s down projection gathered first, this lowers llama3_8b's
    peak on v5p-64; either alone saves nothing (benchmarks/memory.py's figures in
    benchmarks/RESULTS.md)."""
    return _swiglu(activation, gate, up)


def _plain_swiglu(activation, gate, up):
    return ACTIVATIONS[activation](gate) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _swiglu(activation, gate, up):
    return _plain_swiglu(activation, gate, up)


def _swiglu_forward(activation, gate, up):
    return _plain_swiglu(activation, gate, up), (gate, up)


def _swiglu_backward(activation, residuals, grad):
    _, pullback = jax.vjp(functools.partial(_plain_swiglu, activation), *residuals)
    return jax.lax.optimization_barrier(pullback(grad))


_swiglu.defvjp(_swiglu_forward, _swiglu_backward)


def embedding_lookup(table: jax.Array, ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`jnp.take(table, ids, axis=0).astype(dtype)`, its table's gradient made as autodiff makes
    it (the rows' gradients widened to the table's dtype and added up, duplicates included),
    but its rows gathered from the table already cast to `dtype`: the same values.

    Autodiff's backward needs only the ids, yet XLA makes the gather's copy of the table (on a
    TPU, laid out row by row: a float32 copy of the sharded embedding) and,
    having it, reads it again in the optimizer's update, so it lives through the whole step.
    A copy in `dtype` is only the gather's, and dies with it."""
    return _lookup(table.shape, jnp.dtype(table.dtype), jnp.dtype(dtype), table, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _lookup(shape, table_dtype, dtype, table, ids):
    return jnp.take(table.astype(dtype), ids, axis=0)


def _lookup_forward(shape, table_dtype, dtype, table, ids):
    return _lookup(shape, table_dtype, dtype, table, ids), ids


def _lookup_backward(shape, table_dtype, dtype, ids, grad):
    take = jax.linear_transpose(lambda t: jnp.take(t, ids, axis=0),
                                jax.ShapeDtypeStruct(shape, table_dtype))
    grad_table, = take(grad.astype(table_dtype))
    return grad_table, None


_lookup.defvjp(_lookup_forward, _lookup_backward)


def weights_cast_for_use(module: nnx.Module, state: nnx.State) -> nnx.State:
    """`module`'s `state` (a stack of layers' included) with every weight a submodule casts where
    it uses it (its `weight_dtypes`) cast already, the rest as it is.

    A stack's layer loop casts each layer's float32 weights to the compute dtype; XLA hoists that
    cast out of the loop anyway, holding a cast copy of the whole stack. Cast here, outside the
    loop, the loop's gradient of the weights is made and stacked in that dtype too, not float32:
    the same values (each layer's is made in that dtype, `weight_matmul`), and half the memory
    of the stacked gradients, which are alive through the whole backward pass."""
    dtypes = {(*path, name): dtype for path, node in nnx.iter_graph(module)
              if isinstance(node, nnx.Module) and hasattr(node, "weight_dtypes")
              for name, dtype in node.weight_dtypes().items()}

    def cast(path, leaf):
        dtype = dtypes.get(tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)))
        return leaf if dtype is None else leaf.astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, state)


def unquantized_weight_dtypes(layer: nnx.Module,
                              names: tuple[str, ...]) -> dict[str, jnp.dtype]:
    """`weight_dtypes` of an `Attention` or `MLP` layer: its weights `names`, each cast to the
    layer's `grad_dtype` where it is used, except those an fp8 matmul takes (`NAME_fp8` set).
    That matmul quantizes its weight to e4m3 in the layer, where XLA (allowed excess precision)
    evidently skips the cast's rounding; cast before the loop, the weight is rounded twice, and
    tiny's fp8 loss moved 1.2% (benchmarks/RESULTS.md)."""
    return {name: layer.grad_dtype for name in names if getattr(layer, f"{name}_fp8") is None}


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...],
          stddev: float) -> nnx.Param:
    """A float32 normal-initialised parameter annotated with logical axis names."""
    init = jax.nn.initializers.normal(stddev)
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=axes)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis (logical name `axis`), computed in float32
    whatever the input dtype, times `offset + scale`: `offset` 1 is Gemma's form, whose scale
    starts (and decays towards) 0, the identity."""

    def __init__(self, dim: int, eps: float, axis: str = "embed", offset: float = 0.0):
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, jnp.float32), out_sharding=(axis,))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...] + self.offset if self.offset else self.scale[...]
        return (normed * scale).astype(x.dtype)


def float32_accumulating(dtype: jnp.dtype) -> jnp.dtype:
    """The input dtype for a product that must accumulate in float32 (attention, logits).

    XLA:CPU has no float16 x float16 -> float32 dot, so there float16 inputs are widened; GPUs,
    the real home of float16 training, keep them.
    """
    if dtype == jnp.float16 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings; `implementation` names the
    kernel (jaxscale.parallel.attention.IMPLEMENTATIONS). `grad_dtype`: the dtype the weights'
    gradients are made and reduced in (`weight_matmul`; None: `dtype`). `fp8_history` > 0: the
    four projections are fp8 matmuls with that many steps of amax history (`models/fp8.py`).
    `lora`: the adapters of the projections it targets (`models/lora.py`); `dropout` (train
    step only): on their inputs. `qk_norm_eps` (None: none): each head's q and k go through an
    RMSNorm over head_dim with this epsilon before RoPE (Qwen3's q_norm and k_norm), whose
    scale has `norm_offset` added (`RMSNorm`). `window` > 0: a query sees that many tokens,
    itself included (a sliding window); 0: all before it. `query_scale`: q's factor before the
    scores' 1 / sqrt(head_dim) (Gemma's query_pre_attn_scalar sets the scores' scale apart).

    Per layer (`global_every` > 0): layer i is global when (i + 1) is a multiple of it, seeing
    every earlier token with RoPE of `rope_theta` (and `rope_scaling`); the others are local,
    with the window and plain RoPE of `rope_local_theta` (Gemma 3's interleaving). The layer's
    index is an input (`__call__`'s and `decode`'s `layer`), so one scanned block serves both.
    """

    WEIGHT_AXES = {"q": ("embed", "heads", "head_dim"), "k": ("embed", "kv_heads", "head_dim"),
                   "v": ("embed", "kv_heads", "head_dim"), "o": ("heads", "head_dim", "embed")}

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 rope_theta: float, out_stddev: float, dtype: jnp.dtype, implementation: str,
                 rngs: nnx.Rngs, rope_scaling: RopeScaling | None = None, max_segments: int = 0,
                 grad_dtype: jnp.dtype | None = None, fp8_history: int = 0,
                 lora: LoraConfig | None = None, qk_norm_eps: float | None = None,
                 window: int = 0, norm_offset: float = 0.0, query_scale: float = 1.0,
                 global_every: int = 0, rope_local_theta: float = 0.0):
        axes = self.WEIGHT_AXES
        self.q = param(rngs, (d_model, n_heads, head_dim), axes["q"], 0.02)
        self.k = param(rngs, (d_model, n_kv_heads, head_dim), axes["k"], 0.02)
        self.v = param(rngs, (d_model, n_kv_heads, head_dim), axes["v"], 0.02)
        self.o = param(rngs, (n_heads, head_dim, d_model), axes["o"], out_stddev)
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.dtype = dtype
        self.grad_dtype = jnp.dtype(grad_dtype or dtype)
        self.implementation = implementation
        self.max_segments = max_segments
        self.window = window
        self.query_scale = query_scale
        self.global_every = global_every
        self.rope_local_theta = rope_local_theta or rope_theta
        self.q_fp8, self.k_fp8, self.v_fp8, self.o_fp8 = (site(fp8_history) for _ in range(4))
        self.q_lora, self.k_lora, self.v_lora = (adapter(lora, name, getattr(self, name), 1, rngs)
                                                 for name in ("q", "k", "v"))
        self.o_lora = adapter(lora, "o", self.o, 2, rngs)  # o contracts heads and head_dim
        self.q_norm, self.k_norm = (None, None) if qk_norm_eps is None else (
            RMSNorm(head_dim, qk_norm_eps, "head_dim", norm_offset),
            RMSNorm(head_dim, qk_norm_eps, "head_dim", norm_offset))

    def weight_dtypes(self) -> dict[str, jnp.dtype]:
        """The weights (by attribute) and the dtype each is cast to where it is used, fp8
        matmuls' weights left out (`unquantized_weight_dtypes`)."""
        return unquantized_weight_dtypes(self, ("q", "k", "v", "o"))

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None,
                 dropout: AdapterDropout | None = None, layer: jax.Array | None = None
                 ) -> jax.Array:
        """`layer`: the layer's index, which a per-layer pattern (`global_every`) needs."""
        q, k, v = self.project(x, positions, dropout, layer)
        wide = float32_accumulating(self.dtype)
        out = attend(q.astype(wide), k.astype(wide), v.astype(wide), segment_ids,
                     self.implementation, positions=positions, max_segments=self.max_segments,
                     window=self.window, local=self.local(layer))
        return self.output(out, dropout)

    def decode(self, x: jax.Array, cache: KVCache, layer: jax.Array,
               start: jax.Array) -> tuple[jax.Array, KVCache]:
        """Attention for x [batch, length, d_model] at positions start, start + 1, ... (the same
        in every row), after the `start` positions whose keys and values `cache` holds for
        `layer`: writes this layer's new keys and values in, and lets each query see every cached
        position up to its own, or in a windowed layer those of its window, whose cache is a
        ring of the window's length (`KVCache`)."""
        positions = jnp.broadcast_to(start + jnp.arange(x.shape[1]), x.shape[:2])
        q, k, v = self.project(x, positions, layer=layer)
        wide = float32_accumulating(self.dtype)
        q = q.astype(wide)

        def whole(cache, index):
            cache = cache.write(index, start, k, v)
            return attend_to_cache(q, cache.k[index].astype(wide), cache.v[index].astype(wide),
                                   start), cache

        def windowed(cache, index):
            out = attend_through_ring(q, k.astype(wide), v.astype(wide),
                                      cache.local_k[index].astype(wide),
                                      cache.local_v[index].astype(wide), start, self.window)
            return out, cache.write_ring(index, start, k, v)

        # Layers of one kind (the cache holds no other) index their own stack by `layer`.
        if not cache.local_k.shape[0]:
            out, cache = whole(cache, layer)
        elif not cache.k.shape[0]:
            out, cache = windowed(cache, layer)
        else:  # the global layers before this one: `layer // global_every`
            earlier_global = layer // self.global_every
            out, cache = jax.lax.cond(
                self.local(layer), lambda c: windowed(c, layer - earlier_global),
                lambda c: whole(c, earlier_global), cache)
        return self.output(out), cache

    def local(self, layer: jax.Array | None) -> jax.Array | None:
        """Whether `layer` is a local one (traced); None without a per-layer pattern."""
        if not self.global_every:
            return None
        if layer is None:
            raise ValueError("a per-layer pattern (global_every) needs the layer's index")
        return (layer + 1) % self.global_every != 0

    def rotate(self, x: jax.Array, positions: jax.Array, layer: jax.Array | None) -> jax.Array:
        """x [batch, length, heads, head_dim] rotated to `positions` by `layer`'s RoPE."""
        rotated = apply_rope(x, positions, self.rope_theta, self.rope_scaling)
        local = self.local(layer)
        if local is None:
            return rotated
        return jnp.where(local, apply_rope(x, positions, self.rope_local_theta), rotated)

    def project(self, x: jax.Array, positions: jax.Array,
                dropout: AdapterDropout | None = None, layer: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q, k, v) in the compute dtype, q and k normed (`qk_norm_eps`) and rotated to their
        positions (by `layer`'s RoPE), q times `query_scale`."""
        d = dropout
        q = adapted_matmul("btd,dnh->btnh", x, self.weight("q"), self.q_fp8, self.q_lora, d)
        k = adapted_matmul("btd,dkh->btkh", x, self.weight("k"), self.k_fp8, self.k_lora, d)
        v = adapted_matmul("btd,dkh->btkh", x, self.weight("v"), self.v_fp8, self.v_lora, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rotate(q, positions, layer)
        if self.query_scale != 1.0:
            q = (q.astype(jnp.float32) * self.query_scale).astype(q.dtype)
        q = constrain(q, ("batch", "length", "heads", "head_dim"))
        k = constrain(self.rotate(k, positions, layer), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        return q, k, v

    def output(self, out: jax.Array, dropout: AdapterDropout | None = None) -> jax.Array:
        """The heads' outputs [batch, length, heads, head_dim] -> [batch, length, d_model]."""
        return adapted_matmul("btnh,nhd->btd", out.astype(self.dtype), self.weight("o"),
                              self.o_fp8, self.o_lora, dropout)

    def weight(self, name: str) -> jax.Array:
        """The weight `name` as its matmul takes it: in `grad_dtype`, and `gathered` (an fp8
        matmul's is gathered where it is quantized, in fp8: half the bytes)."""
        weight = getattr(self, name)[...].astype(self.grad_dtype)
        if getattr(self, f"{name}_fp8") is not None:
            return weight
        return gathered(weight, self.WEIGHT_AXES[name])


CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


class KVCache(NamedTuple):
    """Every layer's keys (after RoPE) and values for the positions decoded so far, for sampling
    one token at a time, in the compute dtype. The layers that see every earlier token (all of
    them without a window) keep k, v [their count, batch, max_len, kv_heads, head_dim], slot i
    holding position i; the windowed ones keep only their window, local_k, local_v [their count,
    batch, ring, kv_heads, head_dim] with ring = min(window, max_len): slot p % ring holds
    position p, the latest such (`attend_through_ring`). The i-th of each kind is the i-th
    layer of that kind."""
    k: jax.Array
    v: jax.Array
    local_k: jax.Array
    local_v: jax.Array

    def write(self, layer: jax.Array, start: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """The cache with `layer`'s slots start, start + 1, ... set to k, v [batch, length,
        kv_heads, head_dim]; inside a jitted decode loop XLA writes them in place."""
        at = (layer, 0, start, 0, 0)
        return self._replace(
            k=constrain(jax.lax.dynamic_update_slice(self.k, k[None], at), CACHE_AXES),
            v=constrain(jax.lax.dynamic_update_slice(self.v, v[None], at), CACHE_AXES))

    def write_ring(self, layer: jax.Array, start: jax.Array, k: jax.Array,
                   v: jax.Array) -> KVCache:
        """The cache with windowed `layer`'s ring holding positions start, start + 1, ... of
        k, v [batch, length, kv_heads, head_dim]: the last `ring` of them, each at its slot
        position % ring."""
        ring, length = self.local_k.shape[2], k.shape[1]
        n = min(length, ring)
        slots = (start + length - n + jnp.arange(n)) % ring
        # The scalar layer and the slots are both array indices, parted by a slice: numpy's
        # rules put their dimension first, [n, batch, ...].
        return self._replace(
            local_k=constrain(self.local_k.at[layer, :, slots].set(
                jnp.moveaxis(k[:, length - n:], 1, 0)), CACHE_AXES),
            local_v=constrain(self.local_v.at[layer, :, slots].set(
                jnp.moveaxis(v[:, length - n:], 1, 0)), CACHE_AXES))


def attend_to_cache(q: jax.Array, keys: jax.Array, values: jax.Array,
                    start: jax.Array) -> jax.Array:
    """q [batch, length, heads, head_dim] at positions start, start + 1, ...; keys, values
    [batch, max_len, kv_heads, head_dim] by slot. A query sees the slots up to its own position:
    the earlier tokens and itself, never the unwritten slots after it. Plain masked XLA
    attention: a decode step has one query per row; a prefill holds [length, max_len] scores
    per head, which is fine at a prompt's length."""
    slot = jnp.arange(keys.shape[1])
    query = start + jnp.arange(q.shape[1])[:, None]
    visible = slot[None, :] <= query  # [length, max_len]
    return jax.nn.dot_product_attention(q, keys, values, mask=visible[None, None])


def attend_through_ring(q: jax.Array, k: jax.Array, v: jax.Array, ring_k: jax.Array,
                        ring_v: jax.Array, start: jax.Array, window: int) -> jax.Array:
    """A windowed layer's attention for q, k, v [batch, length, ...] at positions start,
    start + 1, ..., through its ring (`KVCache`) as it was before them: ring_k, ring_v
    [batch, ring, kv_heads, head_dim], slot s holding the latest position before `start` that
    is s modulo ring (none while that is negative). A query sees the positions of its window
    among the ring's and the new tokens' (a prefill longer than the ring sees its own tokens
    here, before the ring keeps only its last ones)."""
    ring = ring_k.shape[1]
    held = start - 1 - (start - 1 - jnp.arange(ring)) % ring  # each slot's position
    query = start + jnp.arange(q.shape[1])
    key = jnp.concatenate([held, query])[None, :]
    visible = (key >= 0) & (key <= query[:, None]) & (key > query[:, None] - window)
    return jax.nn.dot_product_attention(q, jnp.concatenate([ring_k, k], axis=1),
                                        jnp.concatenate([ring_v, v], axis=1),
                                        mask=visible[None, None])


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), `activation` a key of ACTIVATIONS (silu:
    SwiGLU; gelu_tanh: GeGLU); x in the compute dtype. `grad_dtype`:
    the dtype the weights' gradients are made and reduced in (`weight_matmul`; None: `dtype`).
    `fp8_history` > 0: the three matmuls are fp8 (`Attention`'s); `lora`: their adapters,
    `dropout` on the adapters' inputs (`Attention`'s). `hidden_chunks` > 1 (a divisor of
    `mlp_dim`; for a layer under remat `full`, with neither fp8 nor adapters): the hidden units
    a chunk at a time (`in_chunks`)."""

    def __init__(self, d_model: int, mlp_dim: int, out_stddev: float, dtype: jnp.dtype,
                 rngs: nnx.Rngs, grad_dtype: jnp.dtype | None = None, fp8_history: int = 0,
                 lora: LoraConfig | None = None, hidden_chunks: int = 1,
                 activation: str = "silu"):
        self.gate = param(rngs, (d_model, mlp_dim), ("embed", "mlp"), 0.02)
        self.activation = activation
        self.up = param(rngs, (d_model, mlp_dim), ("embed", "mlp"), 0.02)
        self.down = param(rngs, (mlp_dim, d_model), ("mlp", "embed"), out_stddev)
        self.grad_dtype = jnp.dtype(grad_dtype or dtype)
        self.gate_fp8, self.up_fp8, self.down_fp8 = (site(fp8_history) for _ in range(3))
        self.gate_lora, self.up_lora, self.down_lora = (
            adapter(lora, name, getattr(self, name), 1, rngs) for name in ("gate", "up", "down"))
        if hidden_chunks > 1 and not MLP.chunkable(fp8_history, lora):
            raise ValueError("fp8 matmuls and adapters take their weights whole: hidden_chunks "
                             f"must be 1, not {hidden_chunks}")
        self.hidden_chunks = hidden_chunks

    @staticmethod
    def chunkable(fp8_history: int, lora: LoraConfig | None) -> bool:
        """Whether the feed-forward can run in chunks: not where its matmuls are fp8 or have
        adapters, which take their weights whole."""
        return not fp8_history and not (lora and {"gate", "up", "down"} & set(lora.targets))

    def weight_dtypes(self) -> dict[str, jnp.dtype]:
        """The weights (by attribute) and the dtype each is cast to where it is used, fp8
        matmuls' weights left out (`unquantized_weight_dtypes`)."""
        return unquantized_weight_dtypes(self, ("gate", "up", "down"))

    def __call__(self, x: jax.Array, dropout: AdapterDropout | None = None) -> jax.Array:
        if self.hidden_chunks > 1:
            return self.in_chunks(x)
        gt = self.grad_dtype
        down = self.down[...].astype(gt)
        if self.down_fp8 is None:
            # The down projection gathered before the gate and up projections: in the backward
            # pass (remat full) it is then gathered before their activations are remade, not
            # beside them (where the TPU compiler for v5p-64 makes it from a zero-padded buffer of
            # its size: a second copy).
            down, x = gathered_before(("mlp", "embed"), down, x)
        gate = adapted_matmul("btd,df->btf", x, self.gate[...].astype(gt), self.gate_fp8,
                              self.gate_lora, dropout)
        up = adapted_matmul("btd,df->btf", x, self.up[...].astype(gt), self.up_fp8, self.up_lora,
                            dropout)
        hidden = constrain(swiglu(gate, up, self.activation), ("batch", "length", "mlp"))
        return adapted_matmul("btf,fd->btd", hidden, down, self.down_fp8, self.down_lora, dropout)

    def in_chunks(self, x: jax.Array) -> jax.Array:
        """The same sum, `hidden_chunks` parts of the hidden units at a time, added in float32: a
        scan whose body the backward pass makes again, so that one chunk's gathered weights,
        activations and weight gradients are alive at once, not the whole layer's (a lower peak
        for llama3_8b on v5p-64 with remat full: benchmarks/RESULTS.md). Chunk c holds every
        n-th block of up to 128 hidden units, starting at block c (n chunks): a TPU keeps the
        blocks' 128-wide minor dimension, and a hidden dimension split over devices in contiguous
        blocks (tensor parallelism) gives each device its own part of every chunk."""
        gt, n = self.grad_dtype, self.hidden_chunks
        d, f = self.gate.shape
        lanes = math.gcd(f // n, 128)

        def columns(weight):  # [d, f] -> [n, d, f / n]
            blocks = jnp.moveaxis(weight.reshape(d, f // n // lanes, n, lanes), 2, 0)
            return blocks.reshape(n, d, f // n)

        @jax.checkpoint
        def add_chunk(total, weights):
            gate, up, down = (w.astype(gt) for w in weights)
            down, chunk_x = gathered_before(("mlp", "embed"), down, x)
            hidden = constrain(swiglu(weight_matmul("btd,df->btf", chunk_x, gate),
                                      weight_matmul("btd,df->btf", chunk_x, up),
                                      self.activation),
                               ("batch", "length", "mlp"))
            return total + weight_matmul("btf,fd->btd", hidden, down, jnp.float32), None

        total = constrain(jnp.zeros(x.shape, jnp.float32), ("batch", "length", "embed"))
        rows = jnp.moveaxis(self.down[...].reshape(f // n // lanes, n, lanes, d), 1, 0)
        rows = rows.reshape(n, f // n, d)
        total, _ = jax.lax.scan(add_chunk, total,
                                (columns(self.gate[...]), columns(self.up[...]), rows))
        return total.astype(x.dtype)
