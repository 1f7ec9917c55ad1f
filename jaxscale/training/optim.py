"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, a decay mask,
Adam's moments stored in float32 or bfloat16 (`optim.moment_dtype`), and with them in host memory
(`optim.offload_state`, jaxscale/training/offload.py) an update that streams them through the
device a layer or a parameter at a time."""

from __future__ import annotations

from typing import Any, Callable

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
# How many parameters' offloaded moments the streamed update holds on the device at once, of
# those it updates whole (not a layer at a time): one updated while the next one's are copied in.
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


def make_optimizer(optim: ml_collections.ConfigDict, total_steps: int, logical_specs,
                   slices: Any = None
                   ) -> tuple[optax.GradientTransformationExtraArgs, optax.Schedule]:
    """AdamW chain for parameters whose logical axes are `logical_specs` (for the decay mask).

    Its update takes gradients in any float dtype (a stack's weights' in the dtype the model made
    them in) and works in each parameter's dtype. It takes `keep`, a boolean scalar (default True):
    where it is False the state it returns is the one it was given, so that the train step can drop
    a non-finite step's update whole. With `apply=True` it returns the new parameters (`applied`)
    instead of the updates, which lets an update that streams a layer at a time apply each layer's
    in place. With `optim.offload_state` the moments live in host memory and the update streams
    them through the device a slice or a parameter at a time (`streamed_update`; `slices`, a tree
    of ints like `logical_specs`, says in how many slices each parameter goes: by default
    whole)."""
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
    # The chain's state is optax.adamw's with clipping (the clip's own is empty); its
    # arithmetic is `clipped`'s, which the streamed update applies a layer at a time.
    clip = optax.clip_by_global_norm(optim.grad_clip) if optim.grad_clip > 0 else None
    chained = optax.chain(*([clip] if clip else []), per_parameter)

    def update(updates, state, params=None, *, keep=True, apply=False, layout=None,
               **extra_args):
        del extra_args  # optax's convention: a chain may pass others' (value=, ...) to every part
        # By the norm of the whole gradient, before any parameter's own part.
        clip_fn = clipped(widened_norm(updates), optim.grad_clip) if clip else None
        if optim.offload_state:
            updates, inner = streamed_update(per_parameter, updates, state[-1], params, keep,
                                             slices, apply, layout, clip_fn)
        else:
            updates = jax.tree.map(lambda g, p: g.astype(p.dtype), updates, params)
            if clip_fn:
                updates = jax.tree.map(clip_fn, updates)
            updates, inner = per_parameter.update(updates, state[-1], params)
            inner = kept(keep, inner, state[-1])
            if apply:
                updates = applied(updates, params, keep, layout)
        return updates, (*state[:-1], inner)

    return optax.GradientTransformationExtraArgs(chained.init, update), schedule


def widened_norm(grads: Any) -> jax.Array:
    """The global norm of `grads`, each leaf squared and summed in float32 whatever its dtype:
    optax's arithmetic, as on the float32 gradients; XLA fuses the widening into the sum."""
    return optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))


def clipped(norm: jax.Array, max_norm: float) -> Callable[[jax.Array], jax.Array]:
    """optax.clip_by_global_norm's arithmetic for one array (or a slice of one) of a gradient
    whose global norm is `norm`: unchanged below `max_norm`, else scaled down to it."""
    def clip_fn(t: jax.Array) -> jax.Array:
        return jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm)
    return clip_fn


def applied(updates: Any, params: Any, keep: jax.Array, layout: Any = None) -> Any:
    """`params` plus `updates`, or `params` where `keep` is False. `layout` (ZeRO-1: the
    moments' shards) is where the updates are added; the new parameters go back to theirs."""
    if layout is not None:
        updates = jax.lax.with_sharding_constraint(updates, layout)
    return kept(keep, optax.apply_updates(params, updates), params)


def kept(keep: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the boolean scalar `keep` is True, else `old` (same trees)."""
    return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, old)


def streamed_update(per_parameter: optax.GradientTransformation, updates: Any, state: Any,
                    params: Any, keep: jax.Array, slices: Any = None, apply: bool = False,
                    layout: Any = None, clip_fn: Callable | None = None) -> tuple[Any, Any]:
    """`per_parameter.update(updates, state, params)` of the `updates` each first passed through
    `clip_fn` (`clipped`), its new state `kept` by `keep` (with `apply`, the new parameters in
    place of the updates: `applied` with `layout`), for a transformation that treats each
    parameter on its own (AdamW's after the global-norm clip) and a `state` whose per-parameter
    entries (the moments) are in host memory. Each parameter's arithmetic is the whole tree's
    update's; what differs is how much of the moments the device holds at once.

    `slices` is a tree of ints like `updates` (None: all 1), each the number of equal slices along
    its parameter's first dimension (one no device splits) that the parameter is updated in, one
    after another in a loop: a stack's layers (`jaxscale.parallel.placement.streamed_slices`), the
    embedding's rows. Each iteration moves that slice's moments to the device, updates them and
    writes them back into the host arrays, so the device holds one slice's moments (and, with
    `apply`, adds the slice's update to its parameters in place, so it holds one slice's update
    too). A loop is what makes it so: XLA schedules a transfer outside a loop as early as its
    operand allows, which for a step's moments (arguments in host memory) is before the backward
    pass (measured: benchmarks/offload.py). Each `updates` leaf is widened to its parameter's dtype
    here, a slice at a time: given the float32 gradient of a stack instead, XLA would make the
    whole of it before the loop (gigabytes for one of llama3_8b's). Each loop's gradient waits, by
    an optimization barrier, for the loop before it to end.

    The parameters in one slice (the final norm's scale; with a split first dimension, the
    embedding and the head) are updated whole, `IN_FLIGHT` at a time: an optimization barrier
    asks that a parameter's moments leave the host only once those of the parameter `IN_FLIGHT`
    places before it are back there. The TPU compiler does not always keep to it: it moved
    llama3_8b's embedding moments in during the backward pass before the embedding went in
    slices (benchmarks/RESULTS.md, "Optimizer state offloaded")."""
    leaves, treedef = jax.tree.flatten(updates)
    index = jax.tree.unflatten(treedef, range(len(leaves)))
    counts = [1] * len(leaves) if slices is None else jax.tree.leaves(slices)
    # Each leaf of the state: the parameter whose entry it is, or -1 (Adam's step count).
    owners = jax.tree.leaves(optax.tree_map_params(per_parameter, lambda _, i: i, state, index,
                                                   transform_non_params=lambda _: -1))
    old, state_def = jax.tree.flatten(state)
    shared = [j for j, o in enumerate(owners) if o == -1]
    new = list(old)  # filled in parameter by parameter
    new_updates = []

    def entries(owner: int) -> list[int]:
        return [j for j, o in enumerate(owners) if o == owner]

    def only(i: int, leaf: Any) -> Any:  # a params-shaped tree of `leaf` at i, else None
        return jax.tree.unflatten(treedef, [leaf if k == i else None for k in range(len(leaves))])

    def update_one(i: int, update, moments, param):
        """Parameter i's update (or a layer of it) and its new moments, `kept`, on the device;
        with the shared entries' new values."""
        one = [old[j] if owners[j] == -1 else None for j in range(len(old))]
        for j, x in zip(entries(i), moments):
            one[j] = x
        one_state = jax.tree.unflatten(state_def, one)
        update = update.astype(param.dtype)  # widened here, a slice at a time
        if clip_fn:
            update = clip_fn(update)
        step, next_state = per_parameter.update(only(i, update), one_state, only(i, param))
        next_leaves = jax.tree.leaves(kept(keep, next_state, one_state),
                                      is_leaf=lambda x: x is None)
        return (jax.tree.leaves(step)[0], [next_leaves[j] for j in entries(i)],
                [next_leaves[j] for j in shared])

    param_leaves = jax.tree.leaves(params)
    layouts = [None] * len(leaves) if layout is None else jax.tree.leaves(layout)
    whole = [i for i in range(len(leaves)) if counts[i] == 1]
    last_loop = None
    for i in range(len(leaves)):
        moments = [old[j] for j in entries(i)]
        if counts[i] > 1:
            if last_loop is not None:
                leaves[i], _ = jax.lax.optimization_barrier((leaves[i], last_loop))
            step, moments, shared_next = _in_slices(
                lambda u, m, p, i=i: update_one(i, u, m, p), leaves[i], moments,
                param_leaves[i], keep if apply else None, counts[i])
            last_loop = step
        else:
            k = whole.index(i)
            if k >= IN_FLIGHT:
                earlier = entries(whole[k - IN_FLIGHT])
                back, moments = jax.lax.optimization_barrier(([new[j] for j in earlier],
                                                              moments))
                for j, x in zip(earlier, back):
                    new[j] = x
            step, moments, shared_next = update_one(
                i, leaves[i], jax.device_put(moments, jax.memory.Space.Device), param_leaves[i])
            moments = jax.device_put(moments, jax.memory.Space.Host)
            if apply:
                step = applied(step, param_leaves[i], keep, layouts[i])
        new_updates.append(step)
        for j, x in zip(entries(i), moments):
            new[j] = x
        for j, x in zip(shared, shared_next):  # the same from every parameter's update
            new[j] = x
    return jax.tree.unflatten(treedef, new_updates), jax.tree.unflatten(state_def, new)


def _in_slices(update_slice, update: jax.Array, moments: list[jax.Array], param: jax.Array,
               keep: jax.Array | None, count: int):
    """`update_slice(a slice of update, the moments' slice on the device, param's slice)` for
    each of `count` equal slices along the first dimension, in a loop, the new moments written
    in place into the host arrays (`moments`): the updates on the device, or with `keep`
    (`apply`) the new parameters, written in place into `param`'s."""
    rows, rest = divmod(update.shape[0], count)
    if rest:
        raise ValueError(f"{count} slices do not divide a dimension of {update.shape[0]}")

    # Host memory is read and written by dynamic (update) slices, which XLA turns into copies
    # between host and device; an index (a gather) or `.at[].set` (a scatter) of an array in host
    # memory runs on the host's processor instead, seconds a step (benchmarks/RESULTS.md). The
    # update is elementwise, so a layer keeps its leading dimension of 1.
    def take(x: jax.Array, k) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(x, k * rows, rows)

    def put(x: jax.Array, part: jax.Array, k) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(x, part, k * rows, 0)

    def one_slice(k, carry):
        out, host, _ = carry
        # Applying, slice k of the parameter is read from the carry, which holds it unchanged
        # until now: reading `param` would keep a second copy of it alive.
        part = take(out if keep is not None else param, k)
        step, new, shared = update_slice(
            take(update, k), jax.device_put([take(m, k) for m in host], jax.memory.Space.Device),
            part)
        if keep is not None:
            step = applied(step, part, keep)
        new = jax.device_put(new, jax.memory.Space.Host)
        return (put(out, step, k), [put(m, x, k) for m, x in zip(host, new)], shared)

    # The loop's carry needs the shapes of what it makes: one slice's update, traced, gives them.
    step, _, shared = jax.eval_shape(
        lambda: update_slice(take(update, 0), jax.device_put([take(m, 0) for m in moments],
                                                             jax.memory.Space.Device),
                             take(param, 0)))
    out = param if keep is not None else jnp.zeros(update.shape, step.dtype)
    return jax.lax.fori_loop(0, count, one_slice,
                             (out, moments, [jnp.zeros(s.shape, s.dtype) for s in shared]))
