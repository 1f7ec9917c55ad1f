"""The pure train and eval steps: loss, gradients, microbatch accumulation, loss scaling.

A batch is a dict of [batch, length] arrays: `inputs`, `targets`, `loss_mask`, `positions`,
`segment_ids`. The loss is next-token cross-entropy in float32, averaged over real (unmasked)
tokens of the whole batch, so k microbatches give exactly the update of one k-times larger batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from jaxscale.models.fp8 import combine_updates, next_meta, step_meta
from jaxscale.models.layers import weights_cast_for_use
from jaxscale.models.lora import AdapterDropout, dropout_key, join_adapters
from jaxscale.models.moe import RouterStats
from jaxscale.parallel.pipeline import Pipeline, one_f_one_b_loss, split_rows
from jaxscale.training.loss import summed_cross_entropy
from jaxscale.training.optim import kept, schedule_at, widened_norm
from jaxscale.training.state import TrainState, uses_dynamic_loss_scale

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


class Weights(NamedTuple):
    """What the model runs with in a step. `params`: the differentiated ones (every parameter,
    or with LoRA the adapters); `frozen`: LoRA's base, which they join (None without); `fp8`: the
    fp8 matmuls' meta (None without), differentiated too: its "gradient" is its next value
    (jaxscale/models/fp8.py)."""
    params: Any
    frozen: Any = None
    fp8: Any = None


class SummedLoss(NamedTuple):
    total: jax.Array  # float32 sum of token losses over the real (unmasked) tokens
    tokens: jax.Array  # float32 count of those tokens
    router: RouterStats | None  # the routers' statistics; None for a model without MoE layers


class ForwardBackward(NamedTuple):
    total: jax.Array  # the summed token loss (the cross-entropy alone, as `SummedLoss.total`)
    grads: Any  # the gradient of the objective times the multiplier, shaped like Weights.params
    router: RouterStats | None  # as in SummedLoss
    next_fp8: Any  # the fp8 meta's next value; None without fp8


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a step computes of a batch: the model of `graphdef` (`ModelSpec.train_graphdef`,
    which takes the fp8 meta when there is one, or `graphdef`), its summed next-token loss with
    the float32 logits made `chunk_len` positions of the sequence and `vocab_tile` entries of the
    vocabulary at a time (0: all at once; jaxscale/training/loss.py), and with MoE layers the
    routers' penalties (`aux_loss_weight`, `z_loss_weight`). With a `pipeline` the blocks run in
    its stages (None: one stage)."""
    graphdef: nnx.GraphDef
    chunk_len: int = 0
    vocab_tile: int = 0
    pipeline: Pipeline | None = None
    aux_loss_weight: float = 0.0
    z_loss_weight: float = 0.0

    @classmethod
    def of(cls, config: ml_collections.ConfigDict, graphdef: nnx.GraphDef,
           pipeline: Pipeline | None) -> Objective:
        m = config.model
        return cls(graphdef, m.loss_chunk_len, m.loss_vocab_tile, pipeline,
                   m.moe.aux_loss_weight, m.moe.z_loss_weight)

    def summed_loss(self, weights: Weights, batch: Batch,
                    dropout: AdapterDropout | None = None) -> SummedLoss:
        """The forward pass: the summed loss and its token count, and the routers' statistics;
        in pipeline stages, on the schedule's forward (GPipe's, for either schedule). `dropout`
        (the train step's; None: none) drops the LoRA adapters' inputs, with a key per row."""
        model = self._model(weights)
        parts = model.parts(batch["inputs"], batch["positions"], batch["segment_ids"], dropout)
        stack = model.default_stack if self.pipeline is None else self.pipeline.stack
        features, router = parts.features(stack)
        mask = batch["loss_mask"].astype(jnp.float32)
        total = summed_cross_entropy(parts.logits_fn, parts.head, parts.head_axes, features,
                                     batch["targets"], mask, self.chunk_len, self.vocab_tile)
        return SummedLoss(total, jnp.sum(mask), router)

    def forward_backward(self, weights: Weights, batch: Batch, multiplier: jax.Array,
                         dropout: AdapterDropout | None = None,
                         made_dtypes: bool = False) -> ForwardBackward:
        """The summed loss and the gradient of `multiplier` x the objective (the summed loss
        plus `router_penalty`) with respect to `weights.params`, with the fp8 meta's next
        value. On a 1F1B pipeline the schedule makes the gradients itself, `multiplier` its
        seed.

        The gradient is taken with respect to the weights as the model uses them
        (`weights_cast_for_use`: a stack's weights in the compute dtype), so each comes out in
        the dtype it was made in. With `made_dtypes` it is returned so (the same values, half
        the memory for those: the optimizer widens it a slice at a time when it streams,
        `make_optimizer`); otherwise in each parameter's own dtype."""
        def scaled(params, fp8):
            w = weights._replace(params=params, fp8=fp8)
            if self.pipeline is not None and self.pipeline.schedule == "1f1b":
                objective, total = self._one_f_one_b(w, batch, multiplier, dropout)
                return objective, (total, None)
            total, tokens, router = self.summed_loss(w, batch, dropout)
            objective = total + self.router_penalty(router, tokens)
            return objective * multiplier, (total, router)
        used = weights_cast_for_use(self._model(weights), weights.params)
        # fp8: the matmuls take this step's scales and amax sinks, whose "gradients" are the
        # amaxes that roll into the histories (jaxscale/models/fp8.py).
        fp8 = None if weights.fp8 is None else step_meta(weights.fp8)
        (_, (total, router)), (grads, amaxes) = jax.value_and_grad(
            scaled, argnums=(0, 1), has_aux=True)(used, fp8)
        if not made_dtypes:
            grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, weights.params)
        return ForwardBackward(total, grads, router,
                               None if fp8 is None else next_meta(weights.fp8, fp8, amaxes))

    def router_penalty(self, router: RouterStats | None, tokens: jax.Array) -> jax.Array:
        """The routers' penalties as a sum over the `tokens` real tokens they were measured on,
        to add to a summed loss: divided by the real-token count, as the step divides the sum,
        the mean loss gains exactly `aux_loss_weight * aux + z_loss_weight * z` (with
        microbatches, of their token-weighted mean)."""
        if router is None:
            return jnp.zeros((), jnp.float32)
        return (self.aux_loss_weight * router.aux_loss
                + self.z_loss_weight * router.z_loss) * tokens

    def _model(self, weights: Weights) -> nnx.Module:
        params = (weights.params if weights.frozen is None
                  else join_adapters(weights.params, weights.frozen))
        return nnx.merge(self.graphdef, params, *([] if weights.fp8 is None else [weights.fp8]))

    def _one_f_one_b(self, weights: Weights, batch: Batch, seed: jax.Array,
                     dropout: AdapterDropout | None) -> tuple[jax.Array, jax.Array]:
        """(seed * summed loss, summed loss) with the blocks, final norm and loss on the 1F1B
        schedule (`jaxscale.parallel.pipeline.one_f_one_b_loss`): differentiate the first."""
        parts = self._model(weights).parts(batch["inputs"], batch["positions"],
                                           batch["segment_ids"], dropout)

        def tail(tail_params, y, targets, mask):
            norm_state, head = tail_params
            return summed_cross_entropy(parts.logits_fn, head, parts.head_axes,
                                        parts.norm(norm_state, y), targets, mask, self.chunk_len,
                                        self.vocab_tile)

        mask = batch["loss_mask"].astype(jnp.float32)
        return one_f_one_b_loss(self.pipeline, parts.layer_fn, parts.stacked, parts.x,
                                parts.per_row, tail, (parts.norm_state, parts.head),
                                (batch["targets"], mask), seed)


def router_metrics(router: RouterStats | None) -> dict[str, jax.Array]:
    if router is None:
        return {}
    return dict(moe_aux_loss=router.aux_loss, moe_z_loss=router.z_loss,
                moe_dropped_fraction=router.dropped_fraction, moe_expert_load=router.expert_load)


def make_train_step(config: ml_collections.ConfigDict, objective: Objective,
                    tx: optax.GradientTransformationExtraArgs, schedule: optax.Schedule, *,
                    grad_shardings: Any = None) -> Callable[[TrainState, Batch], tuple]:
    """Returns train_step(state, batch) -> (state, metrics): one optimizer update per call of
    `objective` (its model, loss and pipeline: `Objective.of`), through `tx` (`make_optimizer`)
    at the rate `schedule` gives.

    `grad_shardings` (ZeRO-1): the layout of the optimizer moments; the gradients are reduced
    onto it (a reduce-scatter instead of an all-reduce), the update is computed on each shard, and
    the new parameters are gathered back to their own layout.
    """
    k = config.train.microbatches
    dynamic_scale = uses_dynamic_loss_scale(config)
    growth_interval = config.precision.loss_scale_growth_interval

    dropout_rate = config.model.lora.dropout if config.model.lora.rank else 0.0

    def accumulate(weights: Weights, batch, multiplier, dropout) -> ForwardBackward:
        if k == 1:
            return objective.forward_backward(weights, batch, multiplier, dropout,
                                              made_dtypes=True)

        def add_microbatch(carry, part):
            microbatch, row_keys = part
            total, grads, router, next_fp8 = objective.forward_backward(
                weights, microbatch, multiplier,
                None if row_keys is None else AdapterDropout(dropout_rate, row_keys))
            acc_total, acc_grads, acc_fp8 = carry
            return (acc_total + total, jax.tree.map(jnp.add, acc_grads, grads),
                    combine_updates(acc_fp8, next_fp8)), router

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, weights.params),
                 jax.tree.map(jnp.zeros_like, weights.fp8))
        parts = jax.tree.map(lambda x: split_rows(x, k), batch)
        # The rows' dropout keys go with their rows (None: no scanned input at all).
        row_keys = None if dropout is None else split_rows(dropout.keys, k)
        (total, grads, next_fp8), routers = jax.lax.scan(add_microbatch, zeros, (parts, row_keys))
        return ForwardBackward(total, grads, jax.tree.map(lambda x: jnp.mean(x, axis=0), routers),
                               next_fp8)

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
        total, grads, router, next_fp8 = accumulate(
            Weights(state.params, state.frozen, state.fp8), batch,
            state.loss_scale / denominator, dropout)
        if dynamic_scale:
            grads = jax.tree.map(lambda g: g / state.loss_scale, grads)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        loss = total / denominator
        grad_norm = widened_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        # The rate is schedule(state.step), whatever optax's count says (see `schedule_at`).
        opt_state = schedule_at(state.opt_state, state.step)
        # The optimizer's own keywords (jaxscale/training/optim.py `make_optimizer`): `keep`, a
        # non-finite step changes nothing but the counters (the update is dropped whole and the
        # optimizer keeps its old state); `apply`, it returns the new parameters, not the updates
        # (an update streamed from host memory applies each slice as it goes); `layout` (ZeRO-1,
        # or None), each update is applied on its shard and the new parameters are gathered.
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
                       skipped=(~finite).astype(jnp.int32), **router_metrics(router))
        if dynamic_scale:
            metrics["loss_scale"] = loss_scale
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               loss_scale=loss_scale, good_steps=good_steps, fp8=fp8,
                               frozen=state.frozen)
        return new_state, metrics

    return train_step


def make_eval_step(objective: Objective) -> Callable:
    """Returns eval_step(params, batch) -> (summed loss, real tokens) of `objective` (whose
    graphdef takes every parameter, `ModelSpec.graphdef`)."""
    def eval_step(params, batch: Batch):
        return objective.summed_loss(Weights(params), batch)[:2]
    return eval_step
