"""The pure train and eval steps: loss, gradients, microbatch accumulation, loss scaling.

A batch is a dict of [batch, length] arrays: `inputs`, `targets`, `loss_mask`, `positions`,
`segment_ids`. The loss is next-token cross-entropy in float32, averaged over real (unmasked)
tokens of the whole batch, so k microbatches give exactly the update of one k-times larger batch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxscale.loss import summed_cross_entropy
from jaxscale.models.llama import HEAD_AXES, logits_from
from jaxscale.parallel.sharding import constrain
from jaxscale.state import TrainState, uses_dynamic_loss_scale

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def summed_loss(graphdef: nnx.GraphDef, params, batch: Batch,
                loss_chunk_len: int = 0) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses over real tokens, number of real tokens), both float32; the logits
    exist `loss_chunk_len` positions of the sequence at a time (0: all at once)."""
    model = nnx.merge(graphdef, params)
    features = model.features(batch["inputs"], batch["positions"], batch["segment_ids"])
    mask = batch["loss_mask"].astype(jnp.float32)
    logits_fn = functools.partial(logits_from, cfg=model.cfg)
    total = summed_cross_entropy(logits_fn, model.head_weight(), HEAD_AXES, features,
                                 batch["targets"], mask, loss_chunk_len)
    return total, jnp.sum(mask)


def _split_microbatches(batch: Batch, k: int) -> Batch:
    """[B, L] -> [k, B/k, L], microbatch j taking rows j, j+k, ... so every device keeps an equal
    share of each microbatch and no data moves between devices."""
    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "batch", "length"))
    return jax.tree.map(split, batch)


def make_train_step(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef,
                    tx: optax.GradientTransformation, schedule: optax.Schedule,
                    grad_shardings: Any = None) -> Callable[[TrainState, Batch], tuple]:
    """Returns train_step(state, batch) -> (state, metrics): one optimizer update per call.

    `grad_shardings` (ZeRO-1): the layout of the optimizer moments; the gradients are reduced
    onto it (a reduce-scatter instead of an all-reduce), the update is computed on each shard, and
    the new parameters are gathered back to their own layout.
    """
    k = config.train.microbatches
    chunk = config.model.loss_chunk_len
    dynamic_scale = uses_dynamic_loss_scale(config)
    growth_interval = config.precision.loss_scale_growth_interval

    def loss_and_grad(params, batch, multiplier):
        """(summed token loss, gradient of the summed loss times `multiplier`)."""
        def scaled(p):
            total, _ = summed_loss(graphdef, p, batch, chunk)
            return total * multiplier, total
        (_, total), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        return total, grads

    def accumulate(params, batch, multiplier):
        if k == 1:
            return loss_and_grad(params, batch, multiplier)

        def add_microbatch(carry, microbatch):
            total, grads = loss_and_grad(params, microbatch, multiplier)
            acc_total, acc_grads = carry
            return (acc_total + total, jax.tree.map(jnp.add, acc_grads, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (total, grads), _ = jax.lax.scan(add_microbatch, zeros, _split_microbatches(batch, k))
        return total, grads

    def train_step(state: TrainState, batch: Batch):
        tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))  # real tokens, whole batch
        denominator = jnp.maximum(tokens, 1.0)
        # Differentiating loss * scale / tokens gives the mean-loss gradient (times the float16
        # loss scale) directly, without another pass over every gradient afterwards.
        total, grads = accumulate(state.params, batch, state.loss_scale / denominator)
        if dynamic_scale:
            grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        loss = total / denominator
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
        if grad_shardings is not None:  # applied on the shard; the new parameters are gathered
            updates = jax.lax.with_sharding_constraint(updates, grad_shardings)
        new_params = optax.apply_updates(state.params, updates)
        # A non-finite step changes nothing but the counters: the update is dropped whole.
        keep_new = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        params = keep_new(new_params, state.params)
        opt_state = keep_new(new_opt_state, state.opt_state)

        loss_scale, good_steps = state.loss_scale, state.good_steps
        if dynamic_scale:
            # float16: halve the scale on overflow; double it after `growth_interval` good steps.
            grow = finite & (good_steps + 1 >= growth_interval)
            loss_scale = jnp.where(finite, jnp.where(grow, loss_scale * 2, loss_scale),
                                   jnp.maximum(loss_scale / 2, 1.0))
            good_steps = jnp.where(finite & ~grow, good_steps + 1, 0)

        metrics = dict(loss=loss, grad_norm=grad_norm, tokens=tokens,
                       lr=schedule(state.step),
                       skipped=(~finite).astype(jnp.int32))
        if dynamic_scale:
            metrics["loss_scale"] = loss_scale
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               loss_scale=loss_scale, good_steps=good_steps)
        return new_state, metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, loss_chunk_len: int) -> Callable:
    """Returns eval_step(params, batch) -> (summed loss, real tokens)."""
    def eval_step(params, batch: Batch):
        return summed_loss(graphdef, params, batch, loss_chunk_len)
    return eval_step
