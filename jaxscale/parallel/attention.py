"""Causal self-attention on the best kernel for the devices it runs on.

Model code calls `attend(q, k, v, segment_ids, implementation)` with logical layouts only; this
module decides the kernel and, for a kernel that XLA cannot split across devices, runs it per shard:

- `xla`: `jax.nn.dot_product_attention`'s XLA path. It materialises the [batch, heads, q, k]
  scores; it is the reference, and what CPUs run. With the length split over mesh axes (the
  `context` axis) it runs inside `shard_map`: each device all-gathers the keys, values, positions
  and segment ids over those axes and keeps its own queries, so a fused kernel could run per shard;
  the causal mask comes from the tokens' positions, not their array indices, because the input
  pipeline lays the tokens out in a load-balanced order (jaxscale/parallel/context.py).
- `splash`: Pallas splash attention (TPU): blockwise, never materialises the scores, skips the
  blocks the causal and document masks hide. A Mosaic kernel is opaque to XLA's partitioner, so it
  runs inside `shard_map` over the mesh, each device on its own batch rows and heads.
- `auto`: splash when the mesh's devices are TPUs, the shapes suit it and the length is whole on
  each device, else xla.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError
from jaxscale.parallel.sharding import active_mesh_and_rules, logical_to_mesh, spec_axes

IMPLEMENTATIONS = ("auto", "xla", "splash")
QUERY_AXES = ("batch", "length", "heads", "head_dim")
KEY_AXES = ("batch", "length", "kv_heads", "head_dim")
SPLASH_BLOCK = 512  # the largest tile; a sequence must be a multiple of min(this, length)
SPLASH_MIN_LENGTH = 128  # TPU kernels tile the sequence in multiples of 128


def attend(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
           implementation: str, *, positions: jax.Array | None = None,
           interpret: bool = False) -> jax.Array:
    """Causal attention. q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads,
    head_dim] (grouped-query: heads a multiple of kv_heads); segment_ids [batch, length] or None:
    a token sees only earlier tokens of its own segment; positions [batch, length] or None (the
    array indices): what "earlier" means when the length is split over devices, whose tokens
    may be in any order. `interpret` runs a Pallas kernel in Python (any backend): for tests."""
    if resolve(implementation, q.shape[1]) == "splash":
        return _splash(q, k, v, segment_ids, interpret)
    if _length_axes():
        return _context(q, k, v, segment_ids, positions)
    return _xla(q, k, v, segment_ids)


def resolve(implementation: str, length: int) -> str:
    """`auto` -> the kernel for the platform of the active mesh (else the default backend)."""
    if implementation != "auto":
        return implementation
    active = active_mesh_and_rules()
    platform = (active[0].devices.flat[0].platform if active is not None
                else jax.default_backend())
    fits = splash_fits(length) and not _length_axes()
    return "splash" if platform == "tpu" and fits else "xla"


def check_implementation(implementation: str, platform: str, length: int) -> None:
    """ConfigError when the kernel asked for cannot run on `platform` at this sequence length."""
    if implementation == "splash" and platform != "tpu":
        raise ConfigError(f"model.attention='splash' is a TPU kernel and the devices are "
                          f"{platform}; use model.attention=auto or xla")
    if implementation == "splash" and not splash_fits(length):
        raise ConfigError(f"model.attention='splash' needs train.seq_len a multiple of "
                          f"{SPLASH_MIN_LENGTH} (and of {SPLASH_BLOCK} above it), not {length}; "
                          "change train.seq_len or use model.attention=auto")


def splash_fits(length: int) -> bool:
    return length % SPLASH_MIN_LENGTH == 0 and length % min(SPLASH_BLOCK, length) == 0


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[batch, 1, q, k]: query q and key k are in the same document (segment)."""
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def _xla(q, k, v, segment_ids):
    # Causality comes from `is_causal`, so without packing there is no mask to materialise.
    mask = None if segment_ids is None else segment_mask(segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)


def _length_axes() -> tuple[str, ...]:
    """The mesh axes of size > 1 that the active rules split the length over (the context axis)."""
    active = active_mesh_and_rules()
    if active is None:
        return ()
    mesh, rules = active
    return tuple(a for a in spec_axes(logical_to_mesh(QUERY_AXES, rules)[1])
                 if mesh.shape[a] > 1)


def _context(q, k, v, segment_ids, positions):
    """XLA attention with the length split over `_length_axes()`: per device, its queries against
    every key, under the mask "same segment and key position <= query position"."""
    mesh, rules = active_mesh_and_rules()
    q_spec, kv_spec = logical_to_mesh(QUERY_AXES, rules), logical_to_mesh(KEY_AXES, rules)
    row_spec = P(*q_spec[:2])
    axes = spec_axes(q_spec[1])  # all of them, in the spec's order, so the gather undoes the split
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)

    def per_shard(q, k, v, positions, segment_ids):
        gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)
        k, v = gather(k), gather(v)
        key_positions, key_segments = gather(positions), gather(segment_ids)
        mask = ((segment_ids[:, :, None] == key_segments[:, None, :])
                & (key_positions[:, None, :] <= positions[:, :, None]))
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
    # check_vma=False: under a pipeline's vmap over stages the output's replication over the
    # stage axis cannot be inferred, though every stage computes its own rows exactly.
    return jax.shard_map(per_shard, mesh=mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, positions, segment_ids)


def _splash(q, k, v, segment_ids, interpret):
    active = active_mesh_and_rules()
    if active is None:
        return _splash_on_shard(q, k, v, segment_ids, interpret=interpret)
    mesh, rules = active
    q_spec, kv_spec = logical_to_mesh(QUERY_AXES, rules), logical_to_mesh(KEY_AXES, rules)
    if _length_axes():
        raise ValueError("splash attention needs the whole sequence on each device; the length "
                         f"axis is split over {q_spec[1]} (use model.attention=xla)")
    seg_spec = P(q_spec[0], None)
    args = (q, k, v) + ((segment_ids,) if segment_ids is not None else ())
    in_specs = (q_spec, kv_spec, kv_spec) + ((seg_spec,) if segment_ids is not None else ())
    body = functools.partial(_splash_on_shard, interpret=interpret)
    if segment_ids is None:
        body = functools.partial(body, segment_ids=None)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=q_spec,
                         check_vma=False)(*args)


def _splash_on_shard(q, k, v, segment_ids, *, interpret):
    """Splash attention on one device's rows and heads (no mesh involved)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (splash_attention_kernel as
                                                                  kernel_lib)
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    batch, length, heads, head_dim = q.shape
    block = min(SPLASH_BLOCK, length)
    sizes = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    causal = masks.MultiHeadMask([masks.CausalMask((length, length))] * heads)
    kernel = kernel_lib.make_splash_mha(causal, block_sizes=sizes, head_shards=1,
                                        q_seq_shards=1, interpret=interpret)
    # The kernel takes [heads, length, head_dim] per sequence and does not scale the queries.
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    q = heads_first(q * np.asarray(head_dim ** -0.5, q.dtype))
    k, v = heads_first(k), heads_first(v)
    if segment_ids is None:
        out = jax.vmap(kernel)(q, k, v)
    else:
        ids = kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
        out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids))(q, k, v, ids)
    return heads_first(out)
