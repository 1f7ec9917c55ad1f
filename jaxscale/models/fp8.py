"""FP8 weight matmuls with delayed per-tensor scaling (`precision.matmul='fp8'`).

What is scaled how. At every weight matmul of the attention and dense feed-forward layers, the
activation x and the weight are quantized to float8_e4m3fn for the forward product, and the
output's gradient to float8_e5m2 for the two backward products (e4m3 x e5m2, as H100 tensor
cores take them). Each of the three has one per-tensor scale, x ~ q * scale, set from the
largest |value| (amax) the last `history` steps saw: scale = amax / fp8_max (margin 0, as
Transformer Engine's default; the history's maximum is the headroom). That is delayed scaling:
this step's tensor is quantized with a scale known before it exists, and its own amax joins the
history for the next step (the history holds the last `history` amaxes in a rotating order, as
Flax's; only their maximum counts). A history of zeros (a fresh run's first step) keeps the
scale it has (1): scaling that first step by its own amax would make every step's quantization
wait for a reduction over its tensor, the cost delayed scaling exists to avoid. The arithmetic
is Flax's (`flax.linen.fp8_ops`: compute_scale, compute_amax_history, quantize, dequantize), the
same as Transformer Engine's. Products accumulate in float32 and are
dequantized (multiplied by both operands' scales) into the output's dtype; the master weights
stay float32, the weight gradient comes out in the dtype it is reduced in, as in bfloat16.
Attention's score and value products, the router, the experts, the output head and the loss
stay in bfloat16/float32: the head's float32 logits are the loss's input.

Where the scales live. Each fp8 matmul site holds an `Fp8Site`: six `Fp8Meta` variables (scale
and amax history of x, the weight and the output's gradient). `Fp8Meta` is an NNX Variable of
its own type, not an `nnx.Param`, so the parameters (`nnx.Param`), the optimizer (no Adam
moments, no weight decay, no clipping), the parameter count and a Hugging Face export never see
it. Being in the blocks, it is stacked along the leading `layers` axis with their parameters and
rides the same scan; the train state keeps it apart from the params as `TrainState.fp8`.

How they update. Once per step, for every layer of a stack at once (`step_meta`), each
operand's scale is set from its history, and the matmuls take those scales and, in place of the
histories, zero "amax sinks"; the step differentiates the loss with respect to that meta too, and
`fp8_matmul`'s backward returns each operand's amax as its sink's "gradient" (a form of Flax's
overwrite-with-gradient trick). After the differentiation `next_meta` rolls every history with
its amax in front, again for the whole stack at once; the step stores the result in place of the
old meta (dropped with the rest of the update on a non-finite step, so an inf never enters a
history). Done per matmul and per layer, this bookkeeping (a reduction over the history, a roll,
an update in place, for each of the three operands) tripled the kernels an fp8 step launches on
a GPU (2,553 fusions against bfloat16's 724 for llama_1b on one H200; on tiny compiled for an
H100, 540 against 225, and 84 in-place updates against none). With microbatches the next values
combine by their maximum, not their sum: each microbatch's history is the old one rolled, with
its own amax in front, so the maximum is the history with the batch's amax in front. Pipeline
schedules use a layer once per microbatch inside one differentiation, where autodiff would sum
those values: fp8 with pipeline stages is refused (jaxscale/parallel/pipeline.py
`check_pipeline`).

Sharding. Scales are one float and histories `history` floats per layer: replicated, but for the
stacked `layers` axis, which follows its rule like every block parameter (logical axes
("layers", None) for both).

Checkpoints. The meta is its own checkpoint item, `fp8/`, written only by fp8 runs
(`jaxscale/checkpoint/`). An fp8 run restoring a bfloat16 checkpoint starts fresh histories
(scale 1, amax 0: the first step quantizes at scale 1 and measures); a bfloat16 run restoring an
fp8 checkpoint does not read the item; a checkpoint whose histories have another length is
refused (ConfigError naming the entry). Evaluation, sampling and export run the master weights
in bfloat16 matmuls (`ModelSpec.graphdef` is the model without meta): the scales are training
state, like Adam's moments. With precision.matmul='bfloat16' no site exists, the train state's
`fp8` is None and every matmul takes `weight_matmul`'s bfloat16 path: the same program as before
fp8 existed.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from jaxscale.errors import ConfigError

FORWARD_DTYPE = jnp.float8_e4m3fn  # x and the weight: more mantissa
BACKWARD_DTYPE = jnp.float8_e5m2  # the output's gradient: more range
# The first compute capability whose tensor cores multiply fp8 (Ada: 8.9, Hopper: 9.0).
FP8_CAPABILITY = (8, 9)


class Fp8Meta(nnx.Variable):
    """A scale or an amax history of one operand of one fp8 matmul: training state that is not a
    parameter (see the module's docstring)."""


class Fp8Site(nnx.Module):
    """The scales and amax histories of one weight matmul's x, weight and output gradient."""

    OPERANDS = ("x", "weight", "grad")

    def __init__(self, history: int):
        for name in self.OPERANDS:
            # Shape (1,), not (): a scalar would get no `layers` axis name when stacked.
            setattr(self, f"{name}_scale",
                    Fp8Meta(jnp.ones((1,), jnp.float32), out_sharding=(None,)))
            setattr(self, f"{name}_history",
                    Fp8Meta(jnp.zeros((history,), jnp.float32), out_sharding=(None,)))

    def values(self) -> tuple[jax.Array, ...]:
        """(x_scale, x_history, weight_scale, weight_history, grad_scale, grad_history)."""
        return tuple(getattr(self, f"{name}_{kind}")[...]
                     for name in self.OPERANDS for kind in ("scale", "history"))


def site(history: int) -> Fp8Site | None:
    """An `Fp8Site` with `history` steps of amax, or None (history 0: the matmul is bfloat16)."""
    return Fp8Site(history) if history else None


def quantized(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """x / scale, clipped to `dtype`'s range and rounded to it (computed in float32)."""
    return fp8_ops.quantize(x.astype(jnp.float32), dtype, scale, jnp.float32)


def _amax(x: jax.Array) -> jax.Array:
    """The largest |x|, float32, shaped like a scale: (1,)."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32).reshape(1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def fp8_matmul(spec, x_dtype, grad_dtype, out_dtype, x, weight, meta):
    """`jnp.einsum(spec, x, weight)` with both operands in e4m3, in `out_dtype`; its backward
    makes x's gradient in `x_dtype` and the weight's in `grad_dtype` from the output gradient in
    e5m2. `meta` (an `Fp8Site.values()` tuple of the step's meta, `step_meta`): each operand's
    scale for this step, and its amax sink, whose gradient is the operand's amax this step."""
    return _forward(spec, x_dtype, grad_dtype, out_dtype, x, weight, meta)[0]


def _forward(spec, x_dtype, grad_dtype, out_dtype, x, weight, meta):
    x_scale, _, w_scale, _, g_scale, _ = meta
    qx, qw = quantized(x, x_scale, FORWARD_DTYPE), quantized(weight, w_scale, FORWARD_DTYPE)
    out = jnp.einsum(spec, qx, qw, preferred_element_type=jnp.float32)
    out = fp8_ops.dequantize(out, jnp.float32, x_scale * w_scale).astype(out_dtype)
    # The residuals are the fp8 operands (a byte an element), the scales and the amaxes.
    return out, (qx, qw, x_scale, w_scale, g_scale, _amax(x), _amax(weight))


def _backward(spec, x_dtype, grad_dtype, out_dtype, residuals, grad):
    qx, qw, x_scale, w_scale, g_scale, x_amax, w_amax = residuals
    qg = quantized(grad, g_scale, BACKWARD_DTYPE)
    x_axes, rest = spec.split(",")
    weight_axes, out_axes = rest.split("->")
    grad_x = jnp.einsum(f"{out_axes},{weight_axes}->{x_axes}", qg, qw,
                        preferred_element_type=jnp.float32)
    grad_x = fp8_ops.dequantize(grad_x, jnp.float32, g_scale * w_scale).astype(x_dtype)
    grad_w = jnp.einsum(f"{x_axes},{out_axes}->{weight_axes}", qx, qg,
                        preferred_element_type=jnp.float32)
    grad_w = fp8_ops.dequantize(grad_w, jnp.float32, g_scale * x_scale).astype(grad_dtype)
    zero = jnp.zeros_like(x_scale)  # the scales get none: they are the step's, set before it
    return grad_x, grad_w, (zero, x_amax, zero, w_amax, zero, _amax(grad))


fp8_matmul.defvjp(_forward, _backward)


# Each operand's format: its largest finite value sets its scale.
_FORMATS = {"x": FORWARD_DTYPE, "weight": FORWARD_DTYPE, "grad": BACKWARD_DTYPE}


def _each_site(fn, meta, *others):
    """`meta` (the fp8 meta's nested dict) with each site's dict, `Fp8Site`'s six entries,
    replaced by fn(that dict, the same dict of each of `others`)."""
    if "x_scale" in meta:
        return fn(meta, *others)
    return {key: _each_site(fn, value, *(o[key] for o in others))
            for key, value in meta.items()}


def step_meta(meta):
    """The meta a step's fp8 matmuls take (`fp8_matmul`), for every layer of a stack at once:
    each operand's scale for this step, set from its amax history (delayed scaling: from the
    steps before this one; a history of zeros keeps the scale), and in place of the history an
    amax sink, zeros of the scale's shape, whose gradient is the operand's amax this step."""
    def step(site):
        out = {}
        for name, dtype in _FORMATS.items():
            scale, history = site[f"{name}_scale"], site[f"{name}_history"]
            out[f"{name}_scale"] = fp8_ops.compute_scale(
                jnp.max(history, axis=-1, keepdims=True), scale,
                fp8_ops.get_fp8_max(dtype, jnp.float32))
            out[f"{name}_history"] = jnp.zeros_like(scale)
        return out
    return _each_site(step, meta)


def next_meta(meta, step, amaxes):
    """The meta after a step: each operand's scale the step's (`step`, from `step_meta`), and
    its history rolled by one with the step's amax in front (`amaxes`: the gradient of the
    step meta, its sinks'), for every layer of a stack at once."""
    def after(site, step_site, amax_site):
        out = {}
        for name in _FORMATS:
            history = site[f"{name}_history"]
            out[f"{name}_scale"] = step_site[f"{name}_scale"]
            out[f"{name}_history"] = jnp.roll(history, -1, axis=-1).at[..., :1].set(
                amax_site[f"{name}_history"])
        return out
    return _each_site(after, meta, step, amaxes)


def combine_updates(a, b):
    """Two microbatches' next meta (see the module's docstring): their maximum."""
    return jax.tree.map(jnp.maximum, a, b)


def check_fp8(matmul: str, device) -> None:
    """ConfigError when `precision.matmul=matmul` cannot run on devices like `device` (a GPU
    without fp8 tensor cores). CPUs and TPUs run it (XLA converts fp8 where the hardware lacks
    it): the numerics are the same, the speed is not."""
    if matmul != "fp8" or device.platform != "gpu":
        return
    capability = str(getattr(device, "compute_capability", ""))
    match = re.fullmatch(r"(\d+)\.(\d+)", capability)
    if match is None or (int(match[1]), int(match[2])) < FP8_CAPABILITY:
        raise ConfigError(
            f"precision.matmul='fp8' needs a GPU with fp8 tensor cores (CUDA compute "
            f"capability {'.'.join(map(str, FP8_CAPABILITY))} or higher: Ada, Hopper) and "
            f"the devices are gpu with compute capability {capability!r}; use "
            "precision.matmul=bfloat16")


def fresh_meta(abstract):
    """The meta of a run that has measured nothing yet, as `abstract` (ShapeDtypeStructs with
    shardings, the tree of `TrainState.fp8`) lays it out: the values `Fp8Site` starts with,
    scales 1 and amax histories 0."""
    values = jax.tree_util.tree_map_with_path(
        lambda path, _: 1.0 if path[-1].key.endswith("_scale") else 0.0, abstract)

    def fresh():
        return jax.tree.map(lambda a, value: jnp.full(a.shape, value, a.dtype), abstract, values)
    # One program for the whole tree, each array born with its sharding.
    return jax.jit(fresh, out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()
