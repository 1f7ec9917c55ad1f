"""Pipeline parallelism over the `pipeline` mesh axis: the stacked layers split into S stages.

The model's blocks are one stacked tree `[layers, ...]` whose `layers` axis the sharding rules map
to `pipeline`, so stage s holds layers `s * L/S ... (s + 1) * L/S - 1`. The same tree, the same
checkpoints, whatever S is. A schedule here runs the stack over stages in SPMD (one program on
every device): per-stage work is a `vmap` over the stage axis with `spmd_axis_name`, so each device
computes its own stage, and activations move to the next stage with a roll of that axis (a
collective permute). The batch goes through as M microbatches (rows j, j + M, ... of each device's
share, so no data moves between data-parallel devices).

- `gpipe`: all forwards, then (by autodiff through the loop) all backwards. With R circular
  repeats, stage s runs layer groups s, s + S, s + 2S, ... and a microbatch goes round the stages
  R times: the bubble shrinks from (S - 1) / (M + S - 1) to (S - 1) / (R * M + S - 1). Autodiff
  keeps every microbatch's activations until the backward: the whole batch's.
- `1f1b`: each tick, every stage runs one forward and one backward (recomputed from the stage
  input it stashed), so at most 2S - 1 microbatches are in flight per stage whatever M is. The loss
  must then be computed inside the loop on the last stage's output (`tail_fn`; every stage
  computes it, replicated, which in lockstep costs no extra time), and the schedule computes
  loss and gradients together (a custom VJP). In lockstep SPMD every tick costs one forward plus
  one backward on every stage, so its bubble is (2S - 2) / (M + 2S - 2): it buys memory with time.
  Nothing else grows with M on a device but an S-th of the microbatches' inputs: each stage holds
  its share and sends stage 0 one microbatch per tick (an all-reduce over the pipeline axis), and
  each microbatch's input gradient goes back into the slot its input left (another). The stage's
  weight gradients accumulate in one float32 buffer, a layer at a time as the backward makes them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError
from jaxscale.parallel.sharding import active_mesh_and_rules, constrain
from jaxscale.parallel.stack import LayerFn, scan_layers

# (tail params, a microbatch's last-stage output, *its per-row tail inputs) -> summed loss.
TailFn = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A schedule for `stages` stages; `microbatches` 0 means 2 * stages."""
    stages: int
    microbatches: int = 0
    repeats: int = 1
    schedule: str = "gpipe"

    @property
    def num_microbatches(self) -> int:
        return self.microbatches or 2 * self.stages

    def bubble_fraction(self) -> float:
        """The share of each stage's step spent idle (theory, equal stage times)."""
        s, m, r = self.stages, self.num_microbatches, self.repeats
        if self.schedule == "1f1b":
            return (2 * s - 2) / (m + 2 * s - 2)
        return (s - 1) / (r * m + s - 1)

    def summary(self) -> str:
        """The start-up line."""
        repeats = f", {self.repeats} circular repeats" if self.repeats > 1 else ""
        return (f"pipeline: {self.stages} stages, {self.num_microbatches} microbatches"
                f"{repeats}, {self.schedule}: bubble {self.bubble_fraction():.1%} of each step")

    def stack(self, layer_fn: LayerFn, stacked_state, x: jax.Array, *per_row) -> jax.Array:
        """A `Stack` (jaxscale.parallel.stack) running the layers as this schedule's forward pass;
        autodiff through it is GPipe's backward. 1F1B trains through `one_f_one_b_loss`; its
        forward alone (evaluation) is the same as GPipe's."""
        return _gpipe(layer_fn, stacked_state, x, per_row, self.stages,
                      self.num_microbatches, self.repeats)


def split_rows(x: jax.Array, k: int) -> jax.Array:
    """[B, ...] -> [k, B/k, ...], part j taking rows j, j + k, ...: with the batch sharded over
    devices, every device keeps an equal share of each part and no data moves."""
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, "batch", "length", "embed")[:x.ndim])


def merge_rows(x: jax.Array) -> jax.Array:
    """The inverse of `split_rows`."""
    x = x.swapaxes(0, 1)
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _stage_axes() -> tuple[str, ...]:
    return tuple(active_mesh_and_rules()[1]["layers"])


def _on_stages(x: jax.Array) -> jax.Array:
    """Pins the leading (stage) axis of `x` to the pipeline axis, leaving the rest to XLA."""
    mesh, _ = active_mesh_and_rules()
    spec = P(_stage_axes(), *[P.UNCONSTRAINED] * (x.ndim - 1))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _by_stage(stacked_state, stages: int, repeats: int):
    """[layers, ...] -> [stages, layers per stage, ...] for one repeat: a reshape of the stored
    layout (stage s's layers are already on its devices). With R repeats, [stages, R, g, ...],
    stage s's repeat r holding layers (r * stages + s) * g ... + g - 1: the groups are exchanged
    once per step between the stored order and this one."""
    def split(a):
        if repeats == 1:
            return _on_stages(a.reshape(stages, a.shape[0] // stages, *a.shape[1:]))
        group = a.shape[0] // (stages * repeats)
        return _on_stages(a.reshape(repeats, stages, group, *a.shape[1:]).swapaxes(0, 1))
    return jax.tree.map(split, stacked_state)


def _circular_stage_fn(layer_fn: LayerFn):
    """(one stage's [repeats, group, ...] state, repeat index, x, *per_row) -> x."""
    def run(stage_state, repeat, x, *per_row):
        group = jax.tree.map(lambda a: a[repeat], stage_state)
        return scan_layers(layer_fn, group, x, *per_row)
    return run


def _per_stage(fn):
    """`fn` mapped over the leading stage axis, each stage on its own pipeline devices."""
    return jax.vmap(fn, spmd_axis_name=_stage_axes())


def _gpipe(layer_fn, stacked_state, x, per_row, stages, microbatches, repeats):
    s_idx = jnp.arange(stages)
    stage_state = _by_stage(stacked_state, stages, repeats)
    if repeats == 1:
        # No per-tick indexing: the stage's weights stay loop constants, whose compute-dtype
        # copies autodiff then keeps once, not once per tick.
        per_stage = _per_stage(functools.partial(scan_layers, layer_fn))
        def run_stages(repeat, inputs, *rows):
            return per_stage(stage_state, inputs, *rows)
    else:
        per_stage = _per_stage(_circular_stage_fn(layer_fn))
        def run_stages(repeat, inputs, *rows):
            return per_stage(stage_state, repeat, inputs, *rows)
    per_row = tuple(split_rows(a, microbatches) for a in per_row)
    # One buffer of microbatch activations: stage 0 reads microbatch t % M from it, the last stage
    # writes its output back in the same slot (a later repeat's input, at the end the result). A
    # slot is read at tick i and rewritten at i + S - 1, so M >= S keeps reads before writes.
    buffer = split_rows(x, microbatches)
    state = _on_stages(jnp.zeros((stages, *buffer.shape[1:]), x.dtype))

    def tick(carry, t):
        state, buffer = carry
        item = t - s_idx  # the microbatch pass each stage works on (invalid in the bubble)
        micro = item % microbatches
        repeat = jnp.clip(item // microbatches, 0, repeats - 1)
        inputs = _on_stages(state.at[0].set(buffer[t % microbatches]))
        rows = tuple(a[micro] for a in per_row)
        out = run_stages(repeat, inputs, *rows)
        last = t - (stages - 1)
        done = (last >= 0) & (last < microbatches * repeats)
        slot = last % microbatches
        buffer = buffer.at[slot].set(jnp.where(done, out[stages - 1], buffer[slot]))
        return (_on_stages(jnp.roll(out, 1, axis=0)), buffer), None

    ticks = jnp.arange(microbatches * repeats + stages - 1)
    (_, buffer), _ = jax.lax.scan(tick, (state, buffer), ticks)
    return merge_rows(buffer)


def one_f_one_b_loss(pipeline: Pipeline, layer_fn: LayerFn, stacked_state, x: jax.Array,
                     per_row: tuple, tail_fn: TailFn, tail_params, tail_rows: tuple,
                     seed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(seed * loss, loss): loss the sum over microbatches of `tail_fn(tail_params, the stack's
    output for the microbatch, *its rows of tail_rows)`, run on the 1F1B schedule. Differentiating
    the first output gives seed * d loss (the seed starts each backward at the tail, as a float16
    loss scale must); the gradients are made by the schedule itself, once."""
    return _one_f_one_b(layer_fn, tail_fn, pipeline.stages, pipeline.num_microbatches,
                        stacked_state, x, per_row, tail_params, tail_rows, seed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _one_f_one_b(layer_fn, tail_fn, stages, microbatches, stacked_state, x, per_row,
                 tail_params, tail_rows, seed):
    (scaled, loss), _ = _run_1f1b(layer_fn, tail_fn, stages, microbatches, stacked_state, x,
                                  per_row, tail_params, tail_rows, seed)
    return scaled, loss


def _forward(layer_fn, tail_fn, stages, microbatches, stacked_state, x, per_row, tail_params,
             tail_rows, seed):
    outputs, grads = _run_1f1b(layer_fn, tail_fn, stages, microbatches, stacked_state, x,
                               per_row, tail_params, tail_rows, seed)
    return outputs, (grads, per_row, tail_rows)


def _backward(layer_fn, tail_fn, stages, microbatches, residuals, cotangents):
    (state_grad, x_grad, tail_grad), per_row, tail_rows = residuals
    g = cotangents[0]  # the second output (the unscaled loss) is not differentiated
    def scale(tree):
        return jax.tree.map(lambda a: (a * g).astype(a.dtype), tree)
    def none_like(tree):
        return jax.tree.map(lambda _: None, tree)
    return (scale(state_grad), scale(x_grad), none_like(per_row), scale(tail_grad),
            none_like(tail_rows), None)


_one_f_one_b.defvjp(_forward, _backward)


def _run_1f1b(layer_fn, tail_fn, stages, microbatches, stacked_state, x, per_row, tail_params,
              tail_rows, seed):
    """Runs the schedule; returns ((seed * loss, loss), (state, x and tail_params gradients of
    seed * loss)). Stage s runs microbatch t - s forward at tick t and microbatch t - 2S + 2 + s
    backward, the last stage both in the same tick, after the tail has made its gradient.

    What a device holds across ticks: its 2S - 1 stashed stage inputs; an S-th of the
    microbatches' inputs (microbatch m on stage m % S, which sends it to stage 0 at tick m), each
    slot taken over by the microbatch's input gradient once read; one float32 accumulator of its
    stage's weight gradients, into which the backward adds each layer's gradient as it is made."""
    s_idx = jnp.arange(stages)
    stash_len = min(microbatches, 2 * stages - 1)  # in flight on stage 0: 2S - 1
    slots = -(-microbatches // stages)
    stage_state = _by_stage(stacked_state, stages, 1)
    x_mb = split_rows(x, microbatches)
    per_row = tuple(split_rows(a, microbatches) for a in per_row)
    tail_rows = tuple(split_rows(a, microbatches) for a in tail_rows)
    activations = jnp.zeros((stages, *x_mb.shape[1:]), x.dtype)
    def f32_zeros(tree):
        return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
    padded = jnp.pad(x_mb, [(0, slots * stages - microbatches)] + [(0, 0)] * (x_mb.ndim - 1))
    inputs_by_stage = _on_stages(padded.reshape(slots, stages, *x_mb.shape[1:]).swapaxes(0, 1))

    def backward_of_stage(state, acc, ok, stage_input, grad_out, *rows):
        """(acc + the stage's weight gradients where ok, the stage input's gradient): the
        stage's forward keeps what each layer's remat policy keeps, and its backward adds each
        layer's weight gradient into acc in place, never holding the whole stage's at once."""
        def run_layer(layer_state, h):
            return layer_fn(layer_state, h, *rows)
        def forward(h, layer_state):
            return jax.vjp(run_layer, layer_state, h)
        _, layer_vjps = jax.lax.scan(forward, stage_input, state)

        def add(a, d, layer):
            # An integer leaf (a layer's index, `Decoder.stack_inputs`) has no gradient (float0).
            if d.dtype == jax.dtypes.float0:
                return a
            return a.at[layer].add(jnp.where(ok, d.astype(a.dtype), 0))

        def backward(carry, layer):
            grad, acc = carry
            d_layer, grad = jax.tree.map(lambda r: r[layer], layer_vjps)(grad)
            acc = jax.tree.map(lambda a, d: add(a, d, layer), acc, d_layer)
            return (grad, acc), None
        layers = jnp.arange(jax.tree.leaves(state)[0].shape[0])
        (grad, acc), _ = jax.lax.scan(backward, (grad_out, acc), layers, reverse=True)
        return acc, grad

    run_forward = _per_stage(functools.partial(scan_layers, layer_fn))
    run_backward = _per_stage(backward_of_stage)
    write_stash = _per_stage(lambda stash, slot, value: stash.at[slot].set(value))
    read_stash = _per_stage(lambda stash, slot: stash[slot])
    write_slot_where = jax.vmap(
        lambda buffer, ok, slot, value: buffer.at[slot].set(jnp.where(ok, value, buffer[slot])),
        in_axes=(0, 0, None, None), spmd_axis_name=_stage_axes())
    def keep_where(ok, new, old):
        return jax.tree.map(
            lambda n, o: jnp.where(ok.reshape(ok.shape + (1,) * (n.ndim - ok.ndim)), n, o),
            new, old)

    def tick(carry, t):
        fwd_in, bwd_in, stash, state_grad, tail_grad, by_stage, total = carry
        # Forward: stage s on microbatch t - s; stage 0's input comes from the stage holding it.
        fwd_item = t - s_idx
        fwd_ok = (fwd_item >= 0) & (fwd_item < microbatches)
        fwd_micro = jnp.clip(fwd_item, 0, microbatches - 1)
        first_in = fwd_micro[0]
        held = by_stage[:, first_in // stages]
        first_input = jnp.sum(keep_where(s_idx == first_in % stages, held, jnp.zeros_like(held)),
                              axis=0)
        inputs = _on_stages(fwd_in.at[0].set(first_input))
        stash = keep_where(fwd_ok, write_stash(stash, fwd_micro % stash_len, inputs), stash)
        rows = tuple(a[fwd_micro] for a in per_row)
        out = run_forward(stage_state, inputs, *rows)
        # The tail on the last stage's output: the loss and the gradient that starts its backward.
        tail_item = t - (stages - 1)
        tail_ok = (tail_item >= 0) & (tail_item < microbatches)
        tail_micro = jnp.clip(tail_item, 0, microbatches - 1)
        loss, tail_vjp = jax.vjp(lambda p, h: tail_fn(p, h, *(a[tail_micro] for a in tail_rows)),
                                 tail_params, out[stages - 1])
        grad_tail, grad_last = tail_vjp(seed.astype(loss.dtype))
        total = total + jnp.where(tail_ok, loss, 0.0)
        tail_grad = jax.tree.map(lambda acc, g: acc + jnp.where(tail_ok, g, 0.0),
                                 tail_grad, grad_tail)
        # Backward: stage s on microbatch t - 2S + 2 + s, recomputed from its stashed input.
        bwd_item = t - 2 * stages + 2 + s_idx
        bwd_ok = (bwd_item >= 0) & (bwd_item < microbatches)
        bwd_micro = jnp.clip(bwd_item, 0, microbatches - 1)
        grads_out = _on_stages(bwd_in.at[stages - 1].set(grad_last.astype(bwd_in.dtype)))
        stage_inputs = read_stash(stash, bwd_micro % stash_len)
        rows = tuple(a[bwd_micro] for a in per_row)
        state_grad, d_input = run_backward(stage_state, state_grad, bwd_ok, stage_inputs,
                                           grads_out, *rows)
        # Stage 0's input gradient goes to the slot its microbatch's input was read from.
        first = bwd_micro[0]
        by_stage = write_slot_where(by_stage, bwd_ok[0] & (s_idx == first % stages),
                                    first // stages, d_input[0])
        fwd_in = _on_stages(jnp.roll(out, 1, axis=0))  # stage s + 1's next input
        bwd_in = _on_stages(jnp.roll(d_input, -1, axis=0))  # stage s - 1's next gradient
        return (fwd_in, bwd_in, stash, state_grad, tail_grad, by_stage, total), None

    stash = _on_stages(jnp.zeros((stages, stash_len, *x_mb.shape[1:]), x.dtype))
    carry = (activations, activations, stash, f32_zeros(stage_state), f32_zeros(tail_params),
             inputs_by_stage, jnp.zeros((), jnp.float32))
    ticks = jnp.arange(microbatches + 2 * stages - 2)
    (_, _, _, state_grad, tail_grad, x_grad, total), _ = jax.lax.scan(tick, carry, ticks)
    state_grad = jax.tree.map(lambda g, a: g.reshape(a.shape).astype(a.dtype), state_grad,
                              stacked_state)
    tail_grad = jax.tree.map(lambda g, a: g.astype(a.dtype), tail_grad, tail_params)
    x_grad = x_grad.swapaxes(0, 1).reshape(slots * stages, *x_mb.shape[1:])[:microbatches]
    return (total * seed, total), (state_grad, merge_rows(x_grad), tail_grad)


def config_pipeline(config: Any, stages: int) -> Pipeline | None:
    """The run's pipeline of `stages` stages (its mesh's `pipeline` axis), or None for one."""
    if stages == 1:
        return None
    p = config.pipeline
    return Pipeline(stages, int(p.microbatches), int(p.repeats), str(p.schedule))


PIPELINE_SCHEDULES = ("gpipe", "1f1b")


def check_pipeline(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """The pipeline section against the mesh: the schedule, the stages' layers and microbatches,
    and what cannot run in stages yet."""
    p, t = config.pipeline, config.train
    if p.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline.schedule={p.schedule!r} is unknown; use one of "
                          f"{PIPELINE_SCHEDULES}")
    stages = mesh_shape["pipeline"]
    if stages == 1:
        return
    if config.model.attention == "cudnn":
        raise ConfigError(f"model.attention='cudnn' cannot run in mesh.pipeline={stages} stages: "
                          "JAX's cuDNN attention has no batching rule for the stages' vmap; use "
                          "model.attention=auto (XLA's attention there) or xla")
    if config.precision.matmul == "fp8":
        # A stage uses a layer once per microbatch inside one differentiation, where autodiff
        # would sum the fp8 meta's next values (jaxscale/models/fp8.py).
        raise ConfigError(
            f"precision.matmul='fp8' with mesh.pipeline={stages} stages is not supported yet (a "
            "stage uses its layers' fp8 scales once per microbatch); use mesh.pipeline=1 or "
            "precision.matmul=bfloat16")
    if config.model.moe.every:
        raise ConfigError(f"mesh.pipeline={stages} with MoE layers (model.moe.every="
                          f"{config.model.moe.every}) is not supported yet; set mesh.pipeline=1 "
                          "and shard the experts with fsdp/tensor")
    rules = config.sharding.rules
    if tuple(rules.get("layers", ())) != ("pipeline",):
        raise ConfigError(f"mesh.pipeline={stages} needs sharding.rules.layers=('pipeline',) "
                          f"(the stages hold the layers), got {tuple(rules.get('layers', ()))}")
    if "pipeline" in {a for name, axes in rules.items() if name != "layers" for a in axes}:
        raise ConfigError("sharding.rules: only 'layers' may name the pipeline mesh axis")
    layers, repeats = config.model.n_layers, p.repeats
    if layers % (stages * repeats):
        raise ConfigError(
            f"model.n_layers={layers} is not divisible by mesh.pipeline x pipeline.repeats = "
            f"{stages} x {repeats}; pick stages and repeats whose product divides {layers}")
    if p.schedule == "1f1b" and repeats > 1:
        raise ConfigError(f"pipeline.schedule='1f1b' runs one group of layers per stage, got "
                          f"pipeline.repeats={repeats}; use repeats=1, or schedule='gpipe' for "
                          "circular repeats")
    micro = p.microbatches or 2 * stages
    rows = t.batch_size // t.microbatches
    if micro < stages:
        raise ConfigError(f"pipeline.microbatches={micro} is fewer than the {stages} stages; "
                          f"use at least {stages} (2 x stages or more keeps the bubble small)")
    batch_shards = math.prod(mesh_shape[a] for a in rules.get("batch", ()))
    if rows % (micro * batch_shards):
        raise ConfigError(
            f"pipeline.microbatches={micro} does not split the {rows} sequences of each step"
            f"{' part' if t.microbatches > 1 else ''} into parts of a multiple of the "
            f"{batch_shards} batch shards; make train.batch_size / train.microbatches a "
            f"multiple of {micro * batch_shards}")
