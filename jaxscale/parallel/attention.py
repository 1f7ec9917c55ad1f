"""Causal self-attention on the best kernel for the devices it runs on.

Model code calls `attend(q, k, v, segment_ids, implementation)` with logical layouts only; this
module decides the kernel and, for a kernel that XLA cannot split across devices, runs it per shard
(inside `shard_map`, each device on its own batch rows and heads):

- `xla`: `jax.nn.dot_product_attention`'s XLA path. It materialises the [batch, heads, q, k]
  scores; it is the reference, and what CPUs run. With the length split over mesh axes (the
  `context` axis) it runs inside `shard_map`: each device all-gathers the keys, values, positions
  and segment ids over those axes and keeps its own queries; the causal mask comes from the
  tokens' positions, not their array indices, because the input pipeline lays the tokens out in
  a load-balanced order (jaxscale/parallel/context.py).
- `splash`: Pallas splash attention (TPU): blockwise, never materialises the scores, skips the
  blocks the causal and document masks hide. A Mosaic kernel is opaque to XLA's partitioner, so it
  runs per shard.
- `cudnn`: cuDNN's fused flash attention (NVIDIA GPUs, bfloat16/float16): never materialises the
  scores. Packed rows take one of two forms. With `max_segments` (`data.max_segments`, which the
  input pipeline guarantees) they go in cuDNN's packed layout, each document a segment given by
  its offset and length: the kernel skips the blocks between documents, the fastest form, but its
  backward takes a float32 workspace of about 8 bytes x batch x max_segments x length x heads x
  head_dim, and it needs a Hopper GPU or newer. Without, the "same document" mask goes in as a
  bias, [batch, 1, q, k] in the compute dtype: memory quadratic in the length but small next to
  the scores XLA keeps (no heads, 2 bytes), and every causal block computed. Runs per shard, like
  splash; with the length split over a context axis, per shard in the mask form, the mask built
  from positions as for xla. Measured on an H100 in benchmarks/RESULTS.md.
- `auto`: splash on TPUs (the length whole on each device) and cudnn on GPUs where the kernel can
  run (shapes, dtype), else xla.

A sliding window (a query sees only the last `window` tokens, itself included) is the XLA path's
local window, one more term of the context path's mask, splash's local mask and cuDNN's sliding
window length. A window that applies to some layers only (Gemma 3's local and global layers, one
scanned block) comes with `local`, a traced bool per layer, which the XLA and context paths take
as a traced mask term; the fused kernels take a window only as a constant, so each device runs
a `lax.cond` between the windowed and the whole kernel (under a pipeline's vmap over stages, on
TPUs, the cond runs both).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError
from jaxscale.parallel.sharding import active_mesh_and_rules, logical_to_mesh, spec_axes

IMPLEMENTATIONS = ("auto", "xla", "splash", "cudnn")
QUERY_AXES = ("batch", "length", "heads", "head_dim")
KEY_AXES = ("batch", "length", "kv_heads", "head_dim")
SPLASH_BLOCK = 512  # the largest tile; a sequence must be a multiple of min(this, length)
SPLASH_MIN_LENGTH = 128  # TPU kernels tile the sequence in multiples of 128
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_PACKED_CAPABILITY = (9, 0)  # Hopper: cuDNN's packed (ragged) layout, heads up to 256
# A window wider than any position (they are below 2^24): a global layer's, where the window is
# per layer and so traced.
NO_WINDOW = 1 << 30


def attend(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
           implementation: str, *, positions: jax.Array | None = None, max_segments: int = 0,
           window: int = 0, local: jax.Array | None = None, interpret: bool = False
           ) -> jax.Array:
    """Causal attention. q [batch, length, heads, head_dim]; k, v [batch, length, kv_heads,
    head_dim] (grouped-query: heads a multiple of kv_heads); segment_ids [batch, length] or None:
    a token sees only earlier tokens of its own segment; positions [batch, length] or None (the
    array indices): what "earlier" means when the length is split over devices, whose tokens
    may be in any order. `max_segments`: the most segments (contiguous runs of one id, padding
    included) a row holds, 0 if unbounded; the cudnn kernel's packed layout needs it. `window`
    > 0: a token sees only the last `window` tokens, itself included; `local` (a traced bool,
    per layer): whether the window applies to this layer, None: to every layer. `interpret` runs
    a Pallas kernel in Python (any backend): for tests."""
    kernel = resolve(implementation, q, packed=segment_ids is not None, max_segments=max_segments)
    local = local if window else None
    if kernel == "splash":
        return _per_shard(functools.partial(_splash_on_shard, interpret=interpret, window=window),
                          q, k, v, segment_ids, local)
    if kernel == "cudnn" and not _length_axes():
        layout = packed_layout_bound(_capability(_device()), max_segments, split=False)
        return _per_shard(functools.partial(_cudnn_on_shard, max_segments=layout, window=window),
                          q, k, v, segment_ids, local)
    if local is not None:  # the XLA and context paths take the window traced
        window = jnp.where(local, window, NO_WINDOW).astype(jnp.int32)
    if _length_axes():
        return _context(q, k, v, segment_ids, positions, kernel, window)
    return _xla(q, k, v, segment_ids, window)


def resolve(implementation: str, q: jax.Array | jax.ShapeDtypeStruct, *, packed: bool,
            max_segments: int = 0) -> str:
    """`auto` -> the kernel for the platform of the active mesh (else the default backend), for
    queries shaped and typed like `q`."""
    if implementation != "auto":
        return implementation
    device = _device()
    return auto_kernel(device.platform, _capability(device), q.dtype, q.shape[1], q.shape[-1],
                       packed=packed, max_segments=max_segments, split=bool(_length_axes()),
                       pipelined=_pipelined())


def auto_kernel(platform: str, capability: str, dtype, length: int, head_dim: int, *,
                packed: bool, max_segments: int, split: bool, pipelined: bool) -> str:
    """What `auto` runs: splash on TPUs (whole rows), cuDNN on NVIDIA GPUs where it can run, else
    XLA. `split`: the length is split
    over a context axis; `pipelined`: inside a pipeline stage's vmap, which JAX's cuDNN attention
    cannot be batched over (its batching rule reshapes the mask's and the segments' arrays as if
    they had the heads' and no stage axis)."""
    if platform == "tpu":
        return "splash" if splash_fits(length) and not split else "xla"
    layout = packed_layout_bound(capability, max_segments, split)
    if pipelined or cudnn_unsupported(platform, capability, dtype, length, head_dim,
                                      mask_form=packed and not layout) is not None:
        return "xla"
    return "cudnn"


def packed_layout_bound(capability: str, max_segments: int, split: bool) -> int:
    """The `max_segments` cuDNN's packed layout runs with: the config's bound on whole rows of a
    Hopper GPU or newer, else 0: packed rows take the mask form."""
    hopper = _cuda_capability(capability) >= CUDNN_PACKED_CAPABILITY
    return max_segments if max_segments and not split and hopper else 0


def cudnn_unsupported(platform: str, capability: str, dtype, length: int, head_dim: int, *,
                      mask_form: bool) -> str | None:
    """Why cuDNN's fused attention cannot run here, or None when it can. `mask_form`: packed
    rows as a document mask (the bias needs an even length)."""
    if platform != "gpu" or _cuda_capability(capability) == (0, 0):
        return (f"it is an NVIDIA GPU kernel and the devices are {platform}"
                + (f" with compute capability {capability!r}" if platform == "gpu" else ""))
    if jnp.dtype(dtype).name not in CUDNN_DTYPES:
        return (f"it computes in {' or '.join(CUDNN_DTYPES)}, not {jnp.dtype(dtype).name} "
                "(precision.compute_dtype)")
    widest = 256 if _cuda_capability(capability) >= CUDNN_PACKED_CAPABILITY else 128
    if head_dim % 8 or head_dim > widest:
        return f"it needs model.head_dim a multiple of 8 and at most {widest}, not {head_dim}"
    if mask_form and length % 2:
        return f"its document mask needs an even train.seq_len, not {length}"
    return None


def check_attention(config: ml_collections.ConfigDict, device) -> None:
    """ConfigError when `model.attention` cannot run on devices like `device` for this config."""
    check_implementation(config.model.attention, device, config.train.seq_len,
                         config.precision.compute_dtype, config.model.head_dim,
                         config.data.max_segments)


def check_implementation(implementation: str, device, length: int, dtype: str, head_dim: int,
                         max_segments: int) -> None:
    """ConfigError when the kernel asked for cannot run on `device`'s kind for these shapes."""
    if implementation == "splash" and device.platform != "tpu":
        raise ConfigError(f"model.attention='splash' is a TPU kernel and the devices are "
                          f"{device.platform}; use model.attention=auto or xla")
    if implementation == "splash" and not splash_fits(length):
        raise ConfigError(f"model.attention='splash' needs train.seq_len a multiple of "
                          f"{SPLASH_MIN_LENGTH} (and of {SPLASH_BLOCK} above it), not {length}; "
                          "change train.seq_len or use model.attention=auto")
    if implementation == "cudnn":
        # Training rows are always packed (segment ids from the input pipeline).
        capability = _capability(device)
        layout = packed_layout_bound(capability, max_segments, split=False)
        why = cudnn_unsupported(device.platform, capability, dtype, length, head_dim,
                                mask_form=not layout)
        if why is not None:
            raise ConfigError(f"model.attention='cudnn' cannot run: {why}; use "
                              "model.attention=auto or xla")


def splash_fits(length: int) -> bool:
    return length % SPLASH_MIN_LENGTH == 0 and length % min(SPLASH_BLOCK, length) == 0


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[batch, 1, q, k]: query q and key k are in the same document (segment)."""
    return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def _xla(q, k, v, segment_ids, window: int | jax.Array = 0):
    # Causality comes from `is_causal`, so without packing there is no mask to materialise; the
    # window counts array indices, which within one packed document are its positions.
    mask = None if segment_ids is None else segment_mask(segment_ids)
    if isinstance(window, int):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                            local_window_size=(window - 1, 0) if window else None)
    index = jnp.arange(q.shape[1])
    in_window = (index[None, :] > index[:, None] - window)[None, None]
    mask = in_window if mask is None else mask & in_window
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)


def _device():
    """A device of the active mesh, else of the default backend."""
    active = active_mesh_and_rules()
    return active[0].devices.flat[0] if active is not None else jax.devices()[0]


def _capability(device) -> str:
    """An NVIDIA GPU's CUDA compute capability ("9.0"); what other devices report, or ""."""
    return str(getattr(device, "compute_capability", ""))


def _cuda_capability(capability: str) -> tuple[int, int]:
    """(major, minor) of a CUDA compute capability; (0, 0) for anything else (a ROCm GPU reports
    its gfx name there)."""
    match = re.fullmatch(r"(\d+)\.(\d+)", capability)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _pipelined() -> bool:
    """Whether the active rules split the layers over a mesh axis of size > 1 (pipeline
    stages): the stages run their layers under a vmap."""
    active = active_mesh_and_rules()
    if active is None:
        return False
    mesh, rules = active
    return any(mesh.shape.get(a, 1) > 1
               for a in spec_axes(logical_to_mesh(("layers",), rules)[0]))


def _length_axes() -> tuple[str, ...]:
    """The mesh axes of size > 1 that the active rules split the length over (the context axis)."""
    active = active_mesh_and_rules()
    if active is None:
        return ()
    mesh, rules = active
    return tuple(a for a in spec_axes(logical_to_mesh(QUERY_AXES, rules)[1])
                 if mesh.shape[a] > 1)


def _context(q, k, v, segment_ids, positions, kernel: str, window: int | jax.Array = 0):
    """Attention with the length split over `_length_axes()`: per device, its queries against
    every key, under the mask "same segment and key position <= query position" (and, with a
    `window`, > query position - window), by XLA or (`kernel` cudnn) cuDNN taking the mask as a
    bias."""
    mesh, rules = active_mesh_and_rules()
    q_spec, kv_spec = logical_to_mesh(QUERY_AXES, rules), logical_to_mesh(KEY_AXES, rules)
    row_spec = P(*q_spec[:2])
    axes = spec_axes(q_spec[1])  # all of them, in the spec's order, so the gather undoes the split
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
    if segment_ids is None:
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)

    def per_shard(q, k, v, positions, segment_ids, window):
        def gather(x):
            return jax.lax.all_gather(x, axes, axis=1, tiled=True)
        k, v = gather(k), gather(v)
        key_positions, key_segments = gather(positions), gather(segment_ids)
        mask = ((segment_ids[:, :, None] == key_segments[:, None, :])
                & (key_positions[:, None, :] <= positions[:, :, None]))
        if not isinstance(window, int) or window:
            mask &= key_positions[:, None, :] > positions[:, :, None] - window
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None],
                                            implementation="cudnn" if kernel == "cudnn" else None)
    # check_vma=False: under a pipeline's vmap over stages the output's replication over the
    # stage axis cannot be inferred, though every stage computes its own rows exactly.
    # A static window stays a Python int (no mask term without one); a traced one goes in
    # replicated.
    static = isinstance(window, int)
    run = jax.shard_map(
        functools.partial(per_shard, window=window) if static else per_shard, mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, row_spec, row_spec) + (() if static else (P(),)),
        out_specs=q_spec, check_vma=False)
    return run(q, k, v, positions, segment_ids, *(() if static else (window,)))


def _per_shard(kernel, q, k, v, segment_ids, local=None):
    """`kernel(q, k, v, segment_ids, local)` on each device's batch rows and heads (`local`, a
    scalar or None, on every device): XLA cannot split a custom kernel across devices itself."""
    active = active_mesh_and_rules()
    if active is None:
        return kernel(q, k, v, segment_ids, local)
    mesh, rules = active
    q_spec, kv_spec = logical_to_mesh(QUERY_AXES, rules), logical_to_mesh(KEY_AXES, rules)
    if _length_axes():
        raise ValueError("a fused attention kernel needs the whole sequence on each device; the "
                         f"length axis is split over {q_spec[1]} (use model.attention=xla)")
    # The optional inputs that are there, each with its spec.
    optional = [(x, spec) for x, spec in ((segment_ids, P(q_spec[0], None)), (local, P()))
                if x is not None]

    def body(q, k, v, *present):
        given = iter(present)
        return kernel(q, k, v, *(next(given) if x is not None else None
                                 for x in (segment_ids, local)))
    in_specs = (q_spec, kv_spec, kv_spec) + tuple(spec for _, spec in optional)
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=q_spec,
                         check_vma=False)(q, k, v, *(x for x, _ in optional))


def _splash_on_shard(q, k, v, segment_ids, local, *, interpret, window):
    """Splash attention on one device's rows and heads (no mesh involved); `local` (traced, or
    None: always): whether this layer has the window."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernel_lib,
    )

    batch, length, heads, head_dim = q.shape
    block = min(SPLASH_BLOCK, length)
    sizes = kernel_lib.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # The kernels' mask tables made as constants: made under the caller's trace (a scan over
    # layers), a cond's branch would carry them out of it as tracers.
    with jax.ensure_compile_time_eval():
        kernels = {w: kernel_lib.make_splash_mha(splash_mask(length, heads, w),
                                                 block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                                 interpret=interpret)
                   for w in {window, 0 if local is not None else window}}
    # The kernel takes [heads, length, head_dim] per sequence and does not scale the queries.
    def heads_first(x):
        return jnp.swapaxes(x, 1, 2)
    q = heads_first(q * np.asarray(head_dim ** -0.5, q.dtype))
    k, v = heads_first(k), heads_first(v)

    def with_window(w):
        def run(q, k, v, segment_ids):
            if segment_ids is None:
                return jax.vmap(kernels[w])(q, k, v)
            ids = kernel_lib.SegmentIds(q=segment_ids, kv=segment_ids)
            return jax.vmap(lambda q, k, v, ids: kernels[w](q, k, v, segment_ids=ids))(q, k, v,
                                                                                        ids)
        return run

    def attention(q, k, v, segment_ids, local):
        if local is None:
            return with_window(window)(q, k, v, segment_ids)
        return jax.lax.cond(local, with_window(window), with_window(0), q, k, v, segment_ids)
    return heads_first(_residuals_made_at_once(attention, q, k, v, segment_ids, local))


def splash_mask(length: int, heads: int, window: int):
    """Splash's mask for every head: causal, and with `window` > 0 a query's own key and the
    `window` - 1 before it (the kernel skips the blocks wholly outside)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (length, length)
    head = (masks.LocalMask(shape, window_size=(window - 1, 0), offset=0) if window
            else masks.CausalMask(shape))
    return masks.MultiHeadMask([head] * heads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _residuals_made_at_once(kernel, *args):
    """`kernel(*args)`, differentiated as autodiff does (the same kernels, the same values),
    but with every residual its backward pass keeps made before the output is used.

    Splash's forward writes each query's log-sum-exp into a [heads, length, 128] float32 buffer
    (a TPU vreg's lanes) and keeps lane 0 for the backward; XLA fuses that slice into the
    backward's first reader, so the whole buffer lives from the forward to the backward: under
    remat `full`, across the feed-forward's backward (with a relaid copy of it), at the step's
    peak."""
    return kernel(*args)


def _residuals_made_at_once_forward(kernel, *args):
    out, pullback = jax.vjp(kernel, *args)
    # The residuals the kernel made (not its inputs, nor the masks' constants), made before the
    # output goes on.
    leaves, tree = jax.tree.flatten(pullback)
    made = [i for i, leaf in enumerate(leaves) if not any(leaf is a for a in args)
            and jnp.issubdtype(leaf.dtype, jnp.floating)]
    out, made_leaves = jax.lax.optimization_barrier((out, [leaves[i] for i in made]))
    for i, leaf in zip(made, made_leaves):
        leaves[i] = leaf
    return out, jax.tree.unflatten(tree, leaves)


def _residuals_made_at_once_backward(kernel, pullback, grad):
    return pullback(grad)


_residuals_made_at_once.defvjp(_residuals_made_at_once_forward,
                               _residuals_made_at_once_backward)


def _cudnn_on_shard(q, k, v, segment_ids, local=None, *, max_segments, window):
    """cuDNN flash attention on one device's rows and heads (no mesh involved); `local`
    (traced, or None: always): whether this layer has the window."""
    if local is not None:
        def with_window(w):
            return functools.partial(_cudnn_on_shard, max_segments=max_segments, window=w)
        return jax.lax.cond(local, with_window(window), with_window(0), q, k, v, segment_ids)
    if segment_ids is None or not max_segments:
        mask = None if segment_ids is None else segment_mask(segment_ids)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                            local_window_size=(window - 1, 0) if window else None,
                                            implementation="cudnn")
    # jax.nn's wrapper has no packed layout; the cuDNN module under it takes segment offsets.
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    lengths, offsets = packed_segments(segment_ids, max_segments)
    return dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                 kv_offsets=offsets, scale=q.shape[-1] ** -0.5,
                                 mask_type=MaskType.PADDING_CAUSAL,
                                 sliding_window_length=window or None)


def packed_segments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed layout of rows whose segments are contiguous runs of one id (padding's 0
    a run too): (lengths int32[batch, M], offsets int32[batch, M + 1]), each row's run lengths
    and start offsets in order, padded with -1, M = `max_segments`. A row with more runs than M
    loses those beyond the M-th (its tokens attend to nothing), and only it: cuDNN lays every
    row's segments end to end, so a row must not list more offsets than lengths. The input
    pipeline cuts such rows (jaxscale/data/packing.py)."""
    length = segment_ids.shape[1]
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    # Each row's first M + 1 start indices, then `length` for the runs it does not have: the
    # (M + 1)-th ends the M-th run.
    first = jax.vmap(lambda row: jnp.nonzero(row, size=max_segments + 1,
                                             fill_value=length)[0])(starts).astype(jnp.int32)
    runs = first[:, :-1] < length
    lengths = jnp.where(runs, first[:, 1:] - first[:, :-1], -1)
    offsets = jnp.where(runs, first[:, :-1], -1)
    return lengths, jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)
