"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, a decay mask,
and Adam's moments stored in float32 or bfloat16 (`optim.moment_dtype`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError

MOMENT_DTYPES = ("float32", "bfloat16")
# The spacing of bfloat16 numbers just below 1 (8 significand bits): a moment that decays by less
# than this fraction per step is rounded back to where it was, so it never decays.
_BFLOAT16_RESOLUTION = 2.0 ** -8


def learning_rate_schedule(optim: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """The rate of step 0, 1, ..., total_steps - 1: linear warmup from 0 to `optim.lr` over the
    first `warmup_steps` steps, then cosine decay that reaches `lr * min_lr_ratio` at the run's
    last step, total_steps - 1 (when warmup leaves it no step to decay over, the last step gets
    the peak)."""
    last = total_steps - 1
    warmup = min(optim.warmup_steps, last)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=warmup,
        decay_steps=max(last, warmup + 1), end_value=optim.lr * optim.min_lr_ratio)


def _is_schedule_state(x) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def schedule_at(opt_state, step: jax.Array):
    """`opt_state` (of `make_optimizer`'s chain) with the schedule's count set to `step`, so the
    next update applies `schedule(step)`.

    The train step calls it with its own step, which every step advances, skipped ones included:
    a skipped step drops one update but not the schedule's progress (optax's count would stop
    with the other optimizer state), so the rate of step s is schedule(s) and the last step's is
    the schedule's end whatever was skipped. Adam's own count still counts the updates applied,
    as its bias correction needs."""
    return jax.tree.map(lambda x: x._replace(count=step) if _is_schedule_state(x) else x,
                        opt_state, is_leaf=_is_schedule_state)


def decay_mask(logical_specs):
    """True for weight matrices, False for norm scales and biases.

    Decided from logical axes rather than ndim: scanned layers stack every parameter along a
    leading `layers` axis, so a per-layer norm scale is 2-D but still a vector per layer.
    """
    return jax.tree.map(lambda spec: sum(a != "layers" for a in spec) >= 2, logical_specs,
                        is_leaf=lambda x: isinstance(x, P))


def check_memory_options(optim: ml_collections.ConfigDict) -> None:
    """ConfigError for an unknown moment dtype, or bfloat16 moments that could not decay."""
    if optim.moment_dtype not in MOMENT_DTYPES:
        raise ConfigError(f"optim.moment_dtype={optim.moment_dtype!r} is unknown; use one of "
                          f"{MOMENT_DTYPES}")
    if optim.moment_dtype == "bfloat16":
        for key in ("b1", "b2"):
            if 1 - optim[key] < _BFLOAT16_RESOLUTION:
                raise ConfigError(
                    f"optim.{key}={optim[key]} with optim.moment_dtype='bfloat16': its moment "
                    f"decays by {1 - optim[key]:.3g} a step, less than bfloat16 resolves next to "
                    f"1 ({_BFLOAT16_RESOLUTION:.3g}), so it would stop decaying; use "
                    f"{key} <= {1 - _BFLOAT16_RESOLUTION:.4f} or optim.moment_dtype='float32'")


def stored_as(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state stored in `dtype`: each update runs in float32 from
    the stored state and rounds the new state to `dtype` once. For Adam that is both mu and nu;
    optax's own `mu_dtype` covers mu only."""
    def cast(tree, to):
        return jax.tree.map(
            lambda x: x.astype(to) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, cast(state, jnp.float32), params)
        return updates, cast(state, dtype)

    return optax.GradientTransformation(init, update)


def make_optimizer(optim: ml_collections.ConfigDict, total_steps: int,
                   logical_specs) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW chain for parameters whose logical axes are `logical_specs` (for the decay mask)."""
    schedule = learning_rate_schedule(optim, total_steps)
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    adam = optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps)
    if optim.moment_dtype != "float32":
        adam = stored_as(adam, jnp.dtype(optim.moment_dtype))
    # optax.adamw's chain, with the Adam part above: the state has adamw's structure, so
    # checkpoints written with either moment dtype have the same entries.
    parts.append(optax.chain(adam,
                             optax.add_decayed_weights(optim.weight_decay,
                                                       decay_mask(logical_specs)),
                             optax.scale_by_learning_rate(schedule)))
    return optax.chain(*parts), schedule
