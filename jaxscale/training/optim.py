"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, a decay mask,
Adam's moments stored in float32 or bfloat16 (`optim.moment_dtype`), and with them in host memory
(`optim.offload_state`, jaxscale/training/offload.py) an update that streams them through the
device a parameter at a time."""

from __future__ import annotations

from typing import Any

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
# How many parameters' offloaded moments the streamed update holds on the device at once: one
# parameter updated while the next one's are copied in.
IN_FLIGHT = 2


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
                   logical_specs) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule]:
    """AdamW chain for parameters whose logical axes are `logical_specs` (for the decay mask).

    Its update takes `keep`, a boolean scalar (default True): where it is False the state it
    returns is the one it was given, so that the train step can drop a non-finite step's update
    whole. With `optim.offload_state` the moments live in host memory and the update streams them
    through the device one parameter at a time (`streamed_update`)."""
    schedule = learning_rate_schedule(optim, total_steps)
    adam = optax.scale_by_adam(b1=optim.b1, b2=optim.b2, eps=optim.eps)
    if optim.moment_dtype != "float32":
        adam = stored_as(adam, jnp.dtype(optim.moment_dtype))
    # optax.adamw's chain, with the Adam part above: the state has adamw's structure, so
    # checkpoints written with either moment dtype have the same entries.
    per_parameter = optax.chain(adam,
                                optax.add_decayed_weights(optim.weight_decay,
                                                          decay_mask(logical_specs)),
                                optax.scale_by_learning_rate(schedule))
    clip = optax.clip_by_global_norm(optim.grad_clip) if optim.grad_clip > 0 else None
    chained = optax.chain(*([clip] if clip else []), per_parameter)

    def update(updates, state, params=None, *, keep=True, **extra_args):
        del extra_args  # optax's convention: a chain may pass others' (value=, ...) to every part
        if clip:  # on the whole gradient, before any parameter's own part; it keeps no state
            updates, _ = clip.update(updates, state[0], params)
        if optim.offload_state:
            updates, inner = streamed_update(per_parameter, updates, state[-1], params, keep)
        else:
            updates, inner = per_parameter.update(updates, state[-1], params)
            inner = kept(keep, inner, state[-1])
        return updates, (*state[:-1], inner)

    return optax.GradientTransformationExtraArgs(chained.init, update), schedule


def kept(keep: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the boolean scalar `keep` is True, else `old` (same trees)."""
    return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, old)


def streamed_update(per_parameter: optax.GradientTransformation, updates: Any, state: Any,
                    params: Any, keep: jax.Array) -> tuple[Any, Any]:
    """`per_parameter.update(updates, state, params)`, its new state `kept` by `keep`, for a
    transformation that treats each parameter on its own (AdamW's after the global-norm clip)
    and a `state` whose per-parameter entries (the moments) are in host memory. It runs one
    parameter at a time: that parameter's moments move to the device, are updated, and go back
    to the host, so the device holds the moments of `IN_FLIGHT` parameters at most instead of
    all of them. Each parameter's arithmetic is the whole tree's update's.

    XLA could still move every parameter's moments in at once; an optimization barrier makes a
    parameter's moments leave the host only once those of the parameter `IN_FLIGHT` places
    before it are back there, which leaves one parameter's copies to overlap another's update."""
    leaves, treedef = jax.tree.flatten(updates)
    index = jax.tree.unflatten(treedef, range(len(leaves)))
    # Each leaf of the state: the parameter whose entry it is, or -1 (Adam's step count).
    owners = jax.tree.leaves(optax.tree_map_params(per_parameter, lambda _, i: i, state, index,
                                                   transform_non_params=lambda _: -1))
    old, state_def = jax.tree.flatten(state)
    new = list(old)  # filled in parameter by parameter
    new_updates = []

    def entries(owner: int) -> list[int]:
        return [j for j, o in enumerate(owners) if o == owner]

    def only(i: int, tree: Any) -> Any:  # parameter i's leaf of a params-shaped tree, else None
        return jax.tree.map(lambda x, k: x if k == i else None, tree, index)

    for i in range(len(leaves)):
        moments = [old[j] for j in entries(i)]
        if i >= IN_FLIGHT:
            earlier = entries(i - IN_FLIGHT)
            back, moments = jax.lax.optimization_barrier(([new[j] for j in earlier], moments))
            for j, x in zip(earlier, back):
                new[j] = x
        # Parameter i's entries on the device, the shared ones as they were, no others.
        one = [old[j] if owners[j] == -1 else None for j in range(len(old))]
        for j, x in zip(entries(i), jax.device_put(moments, jax.memory.Space.Device)):
            one[j] = x
        one_state = jax.tree.unflatten(state_def, one)
        update, next_state = per_parameter.update(only(i, updates), one_state, only(i, params))
        new_updates += jax.tree.leaves(update)
        next_leaves = jax.tree.leaves(kept(keep, next_state, one_state),
                                      is_leaf=lambda x: x is None)
        for j in entries(i):
            new[j] = jax.device_put(next_leaves[j], jax.memory.Space.Host)
        for j in entries(-1):  # the same from every parameter's update
            new[j] = next_leaves[j]
    return jax.tree.unflatten(treedef, new_updates), jax.tree.unflatten(state_def, new)
