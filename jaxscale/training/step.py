"""The pure train and eval steps: loss, gradients, microbatch accumulation, loss scaling.

A batch is a dict of [batch, length] arrays: `inputs`, `targets`, `loss_mask`, `positions`,
`segment_ids`. The loss is next-token cross-entropy in float32, averaged over real (unmasked)
tokens of the whole batch, so k microbatches give exactly the update of one k-times larger batch.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxscale.training.loss import summed_cross_entropy
from jaxscale.models.fp8 import combine_updates
from jaxscale.models.layers import weights_cast_for_use
from jaxscale.models.lora import AdapterDropout, dropout_key, join_adapters
from jaxscale.models.moe import RouterStats
from jaxscale.training.optim import kept, schedule_at, widened_norm
from jaxscale.parallel.pipeline import Pipeline, one_f_one_b_loss, split_rows
from jaxscale.training.state import TrainState, uses_dynamic_loss_scale

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def summed_loss(graphdef: nnx.GraphDef, params, batch: Batch, loss_chunk_len: int = 0,
                loss_vocab_tile: int = 0, pipeline: Pipeline | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses over real tokens, number of real tokens), both float32; the logits
    exist `loss_chunk_len` positions of the sequence and `loss_vocab_tile` entries of the
    vocabulary at a time (0: all at once). With a `pipeline`, the blocks run on its schedule's
    forward pass (GPipe's, for either schedule)."""
    total, tokens, _ = summed_loss_and_router_stats(graphdef, params, batch, loss_chunk_len,
                                                    loss_vocab_tile, pipeline)
    return total, tokens


def summed_loss_and_router_stats(graphdef: nnx.GraphDef, params, batch: Batch,
                                 loss_chunk_len: int = 0, loss_vocab_tile: int = 0,
                                 pipeline: Pipeline | None = None,
                                 fp8=None, dropout: AdapterDropout | None = None
                                 ) -> tuple[jax.Array, jax.Array, RouterStats | None]:
    """`summed_loss`, and the routers' statistics (None for a model without MoE layers). `fp8`:
    the fp8 matmuls' meta, for a `graphdef` that has them (`ModelSpec.train_graphdef`);
    `dropout`: on the LoRA adapters' inputs (the train step's)."""
    model = nnx.merge(graphdef, params) if fp8 is None else nnx.merge(graphdef, params, fp8)
    parts = model.parts(batch["inputs"], batch["positions"], batch["segment_ids"], dropout)
    features, router = parts.features(model.default_stack if pipeline is None else pipeline.stack)
    mask = batch["loss_mask"].astype(jnp.float32)
    total = summed_cross_entropy(parts.logits_fn, parts.head, parts.head_axes, features,
                                 batch["targets"], mask, loss_chunk_len,
                                 loss_vocab_tile)
    return total, jnp.sum(mask), router


def router_penalty(moe: ml_collections.ConfigDict, router: RouterStats | None,
                   tokens: jax.Array) -> jax.Array:
    """The routers' penalties as a sum over the `tokens` real tokens they were measured on, to
    add to a summed loss: divided by the real-token count, as the step divides the sum, the mean
    loss gains exactly `moe.aux_loss_weight * aux + moe.z_loss_weight * z` (with microbatches,
    of their token-weighted mean). `moe` is the config's `model.moe`."""
    if router is None:
        return jnp.zeros((), jnp.float32)
    return (moe.aux_loss_weight * router.aux_loss + moe.z_loss_weight * router.z_loss) * tokens


def router_metrics(router: RouterStats | None) -> dict[str, jax.Array]:
    if router is None:
        return {}
    return dict(moe_aux_loss=router.aux_loss, moe_z_loss=router.z_loss,
                moe_dropped_fraction=router.dropped_fraction, moe_expert_load=router.expert_load)


def one_f_one_b_summed_loss(graphdef: nnx.GraphDef, params, batch: Batch, loss_chunk_len: int,
                            loss_vocab_tile: int, pipeline: Pipeline, seed: jax.Array,
                            dropout: AdapterDropout | None = None) -> tuple[jax.Array, jax.Array]:
    """(seed * summed loss, summed loss) with the blocks, final norm and loss on the 1F1B schedule
    (`jaxscale.parallel.pipeline.one_f_one_b_loss`): differentiate the first."""
    parts = nnx.merge(graphdef, params).parts(batch["inputs"], batch["positions"],
                                              batch["segment_ids"], dropout)

    def tail(tail_params, y, targets, mask):
        norm_state, head = tail_params
        return summed_cross_entropy(parts.logits_fn, head, parts.head_axes,
                                    parts.norm(norm_state, y), targets, mask, loss_chunk_len,
                                    loss_vocab_tile)

    mask = batch["loss_mask"].astype(jnp.float32)
    return one_f_one_b_loss(pipeline, parts.layer_fn, parts.stacked, parts.x, parts.per_row,
                            tail, (parts.norm_state, parts.head), (batch["targets"], mask), seed)


def loss_grad_and_next_fp8(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef, params,
                           fp8, batch: Batch, multiplier: jax.Array, frozen=None,
                           dropout: AdapterDropout | None = None, made_dtypes: bool = False,
                           pipeline: Pipeline | None = None
                           ) -> tuple[jax.Array, Any, dict[str, jax.Array], Any]:
    """(summed token loss, gradient of the summed loss times `multiplier`, `router_metrics` ({}
    without MoE), the fp8 meta's next value). With MoE the summed loss stays the cross-entropy
    alone and the gradient is that of the cross-entropy plus `router_penalty`. A model with fp8
    matmuls has its meta `fp8` (None without) differentiated too: its "gradient" is its next
    value (jaxscale/models/fp8.py). With LoRA `params` are the adapters, the only thing
    differentiated, and `frozen` the base they join; `dropout` (None: none) drops the adapters'
    inputs, with a key per row of `batch`; `pipeline` (None: none) runs the blocks in stages on
    its schedule.

    The gradient is taken with respect to the weights as the model uses them
    (`weights_cast_for_use`: a stack's weights in the compute dtype), so each comes out in the
    dtype it was made in. With `made_dtypes` it is returned so (the same values, half the memory
    for those: the optimizer widens it a slice at a time when it streams, `make_optimizer`);
    otherwise in each parameter's own dtype."""
    slices = config.model.loss_chunk_len, config.model.loss_vocab_tile

    def scaled(adapted, meta):
        p = adapted if frozen is None else join_adapters(adapted, frozen)
        if pipeline is None or pipeline.schedule != "1f1b":
            total, tokens, router = summed_loss_and_router_stats(graphdef, p, batch, *slices,
                                                                 pipeline, meta, dropout)
            objective = total + router_penalty(config.model.moe, router, tokens)
            return objective * multiplier, (total, router_metrics(router))
        # 1F1B differentiates its own schedule: it takes the multiplier as its seed.
        objective, total = one_f_one_b_summed_loss(graphdef, p, batch, *slices, pipeline,
                                                   multiplier, dropout)
        return objective, (total, {})
    model = nnx.merge(graphdef, params if frozen is None else join_adapters(params, frozen),
                      *([] if fp8 is None else [fp8]))
    (_, (total, router)), (grads, next_fp8) = jax.value_and_grad(
        scaled, argnums=(0, 1), has_aux=True)(weights_cast_for_use(model, params), fp8)
    if not made_dtypes:
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return total, grads, router, next_fp8


def make_train_step(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef,
                    tx: optax.GradientTransformationExtraArgs, schedule: optax.Schedule, *,
                    pipeline: Pipeline | None, grad_shardings: Any = None
                    ) -> Callable[[TrainState, Batch], tuple]:
    """Returns train_step(state, batch) -> (state, metrics): one optimizer update per call, the
    blocks in `pipeline`'s stages when there is one (`TrainProgram.pipeline`).

    `grad_shardings` (ZeRO-1): the layout of the optimizer moments; the gradients are reduced
    onto it (a reduce-scatter instead of an all-reduce), the update is computed on each shard, and
    the new parameters are gathered back to their own layout.
    """
    k = config.train.microbatches
    dynamic_scale = uses_dynamic_loss_scale(config)
    growth_interval = config.precision.loss_scale_growth_interval

    dropout_rate = config.model.lora.dropout if config.model.lora.rank else 0.0

    def accumulate(params, fp8, frozen, batch, multiplier, dropout):
        if k == 1:
            return loss_grad_and_next_fp8(config, graphdef, params, fp8, batch, multiplier,
                                          frozen, dropout, made_dtypes=True, pipeline=pipeline)

        def add_microbatch(carry, part):
            microbatch, row_keys = part
            total, grads, router, next_fp8 = loss_grad_and_next_fp8(
                config, graphdef, params, fp8, microbatch, multiplier, frozen,
                None if row_keys is None else AdapterDropout(dropout_rate, row_keys),
                pipeline=pipeline)
            acc_total, acc_grads, acc_fp8 = carry
            return (acc_total + total, jax.tree.map(jnp.add, acc_grads, grads),
                    combine_updates(acc_fp8, next_fp8)), router

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params),
                 jax.tree.map(jnp.zeros_like, fp8))
        parts = jax.tree.map(lambda x: split_rows(x, k), batch)
        # The rows' dropout keys go with their rows (None: no scanned input at all).
        row_keys = None if dropout is None else split_rows(dropout.keys, k)
        (total, grads, next_fp8), routers = jax.lax.scan(add_microbatch, zeros, (parts, row_keys))
        return total, grads, jax.tree.map(lambda x: jnp.mean(x, axis=0), routers), next_fp8

    def train_step(state: TrainState, batch: Batch):
        tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))  # real tokens, whole batch
        denominator = jnp.maximum(tokens, 1.0)
        # Differentiating loss * scale / tokens gives the mean-loss gradient (times the float16
        # loss scale) directly, without another pass over every gradient afterwards.
        # LoRA dropout: a key per row of the whole batch, from train.seed, the step and the row,
        # so a row draws the same masks whatever the microbatches, mesh or pipeline, and a
        # resumed run replays them. Without dropout there is no key and the program is as it was.
        dropout = None if not dropout_rate else AdapterDropout.for_rows(
            dropout_rate, dropout_key(config.train.seed, state.step), batch["inputs"].shape[0])
        total, grads, router, next_fp8 = accumulate(state.params, state.fp8, state.frozen,
                                                    batch, state.loss_scale / denominator,
                                                    dropout)
        if dynamic_scale:
            grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        loss = total / denominator
        grad_norm = widened_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        # The rate is schedule(state.step), whatever optax's count says (see `schedule_at`).
        opt_state = schedule_at(state.opt_state, state.step)
        # A non-finite step changes nothing but the counters: the update is dropped whole (the
        # optimizer keeps its old state itself, `keep`).
        # ZeRO-1: each update applied on its shard; the new parameters are gathered.
        params, opt_state = tx.update(grads, opt_state, state.params, keep=finite, apply=True,
                                      layout=grad_shardings)
        fp8 = kept(finite, next_fp8, state.fp8)

        loss_scale, good_steps = state.loss_scale, state.good_steps
        if dynamic_scale:
            # float16: halve the scale on overflow; double it after `growth_interval` good steps.
            grow = finite & (good_steps + 1 >= growth_interval)
            loss_scale = jnp.where(finite, jnp.where(grow, loss_scale * 2, loss_scale),
                                   jnp.maximum(loss_scale / 2, 1.0))
            good_steps = jnp.where(finite & ~grow, good_steps + 1, 0)

        # The rate this step's update applied: 0 when it was dropped.
        metrics = dict(loss=loss, grad_norm=grad_norm, tokens=tokens,
                       lr=jnp.where(finite, schedule(state.step), 0.0),
                       skipped=(~finite).astype(jnp.int32), **router)
        if dynamic_scale:
            metrics["loss_scale"] = loss_scale
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               loss_scale=loss_scale, good_steps=good_steps, fp8=fp8,
                               frozen=state.frozen)
        return new_state, metrics

    return train_step


def make_eval_step(config: ml_collections.ConfigDict, graphdef: nnx.GraphDef, *,
                   pipeline: Pipeline | None) -> Callable:
    """Returns eval_step(params, batch) -> (summed loss, real tokens), the blocks in `pipeline`'s
    stages when there is one."""
    def eval_step(params, batch: Batch):
        return summed_loss(graphdef, params, batch, config.model.loss_chunk_len,
                           config.model.loss_vocab_tile, pipeline)
    return eval_step
