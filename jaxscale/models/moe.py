"""A mixture-of-experts feed-forward layer, in place of the dense SwiGLU `MLP`.

A float32 router scores every token against `experts` SwiGLU experts; each token goes to its
`top_k` best, weighted by their router probabilities (renormalised to sum to 1 when top_k > 1).
Dispatch is by capacity, per batch row (a row is a group: routing never moves tokens between
rows, so it stays local to the devices that hold the row): each expert has `capacity` slots per
row, assignments past that are dropped (the token keeps its residual path for that choice).
Priority order: every token's first choice before any token's second choice (and so on), and
within one choice, earlier places in the row first (GShard / Switch Transformer), so a token loses
its later choices before any token loses its first. (With a context axis the row is in the input's
load-balanced order, so "earlier" is that order's.)

Tokens reach their slots by a stable sort of the assignments by expert and a cumulative count
(`route`), then one gather into `[batch, experts, capacity, d_model]`; the experts run as batched
matmuls over the stacked weights `[experts, ...]`; a gather brings each assignment's output back
and the weighted sum combines a token's choices. No [tokens, experts, capacity] one-hot masks.
With the experts split over devices (the `experts` logical axis), the buffers travel to their
experts' devices and back by all-to-all (`jaxscale.parallel.experts`).

Dropless (`capacity_factor` 0, MaxText's default; decoding always): nothing is dropped and there
are no buffers. Each device sorts its own tokens' assignments by expert, gathers them into one
[assignments, d_model] array and runs the experts as grouped matmuls (`jax.lax.ragged_dot`, one
group of rows per expert); a gather by the inverse permutation brings each assignment's output
back for the same weighted sum. With the experts split over devices, the weights come to the
tokens instead (`on_token_shards`, which says why).

The layer also returns `RouterStats`, over the whole batch: the load-balancing loss (Switch
Transformer, eq. 4) `experts * sum_e f_e * P_e`, with f_e expert e's share of the top_k
assignments (the f sum to 1) and P_e its mean router probability: 1 when both are even, more as
routing concentrates (Hugging Face Mixtral's f sum to top_k, so its loss is top_k times this);
the router z-loss (ST-MoE, eq. 5) `mean_t logsumexp(logits_t)^2`; the fraction of assignments
dropped; every expert's f. Padding (tokens of segment id 0) is not routed: it takes no slot, gets
a zero output (its residual path only) and is left out of every statistic, so a packed batch's
empty tail neither crowds real tokens out of their experts nor moves the balancing loss.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.layers import param, weight_matmul
from jaxscale.models.lora import LoraConfig, adapter
from jaxscale.parallel.experts import constrain_experts, on_token_shards, to_experts, to_tokens

BUFFERS = ("batch", "experts", None, "embed")  # dispatched tokens [batch, experts, capacity, d]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """The model's `moe` settings (config group `model.moe`, when `every` > 0); the loss
    weights of the router statistics are the train step's
    (`training.step.Objective.router_penalty`)."""
    experts: int
    top_k: int = 2
    capacity_factor: float = 1.25  # 0: dropless
    every: int = 1  # every n-th layer's feed-forward is an MoE layer (the last of each n)

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a row of `tokens` tokens: `capacity_factor` times an even share
        of the row's top_k * tokens assignments, rounded up; never more than `tokens`, since an
        expert gets each token at most once."""
        even_share = tokens * self.top_k / self.experts
        return max(1, min(tokens, math.ceil(self.capacity_factor * even_share)))


class RouterStats(NamedTuple):
    """Float32 statistics of the routers, each a mean over the MoE layers."""
    aux_loss: jax.Array  # load balancing: experts * sum_e load_e * mean_prob_e; 1 when even
    z_loss: jax.Array  # mean over tokens of logsumexp(router logits)^2
    dropped_fraction: jax.Array  # assignments (token, choice) that found their expert full
    expert_load: jax.Array  # [experts]: each expert's share of the assignments, before dropping

    def plus(self, other: RouterStats) -> RouterStats:
        return jax.tree.map(jnp.add, self, other)

    def scaled(self, factor: float) -> RouterStats:
        return jax.tree.map(lambda x: x * factor, self)

    @classmethod
    def zeros(cls, experts: int) -> RouterStats:
        scalar = jnp.zeros((), jnp.float32)
        return cls(scalar, scalar, scalar, jnp.zeros((experts,), jnp.float32))


class Routing(NamedTuple):
    """One row's routing decision. Assignments are laid out choice-major (assignment j * tokens
    + t is token t's j-th choice), which is also their priority order."""
    expert: jax.Array  # int32 [assignments]
    weight: jax.Array  # float32 [assignments]: renormalised router probability
    slot: jax.Array  # int32 [assignments]: place in the expert's buffer; >= capacity: dropped
    source: jax.Array  # int32 [experts, capacity]: the token in each slot
    filled: jax.Array  # bool [experts, capacity]: whether a token is in the slot
    real: jax.Array  # bool [assignments]: the assignment is a real token's (not padding's)


def route(probs: jax.Array, top_k: int, capacity: int, valid: jax.Array | None = None) -> Routing:
    """float32 router probabilities [tokens, experts] of one row -> its `Routing`. `valid`
    (bool [tokens]; default all) marks real tokens: padding's assignments take no slot."""
    tokens, experts = probs.shape
    weights, chosen = jax.lax.top_k(probs, top_k)  # [tokens, top_k]
    if top_k > 1:
        # Renormalised over the chosen experts (Mixtral). A single choice keeps its raw
        # probability (Switch): renormalised, it would be 1 and give the router no gradient.
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    expert, weight = chosen.T.reshape(-1), weights.T.reshape(-1)  # choice-major: priority order
    real = jnp.ones_like(expert, bool) if valid is None else jnp.tile(valid, top_k)
    # Grouped by expert; the stable sort keeps the priority order within each expert, so an
    # assignment's rank in its group is its slot. Padding queues behind every real assignment,
    # under a void expert `experts` that has no slots.
    group = jnp.where(real, expert, experts)
    order = jnp.argsort(group, stable=True)
    counts = jnp.bincount(group, length=experts + 1)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(expert.shape[0]) - starts[group[order]]
    slot = jnp.where(real, jnp.zeros_like(expert).at[order].set(rank), capacity)
    counts, starts = counts[:experts], starts[:experts]
    place = jnp.arange(capacity)
    filled = place[None, :] < counts[:, None]
    # Slot c of expert e holds the (starts[e] + c)-th assignment in sorted order, when filled.
    sorted_index = jnp.minimum(starts[:, None] + place[None, :], expert.shape[0] - 1)
    source = order[sorted_index] % tokens
    return Routing(expert, weight, slot, source, filled, real)


def dispatch(x: jax.Array, routing: Routing) -> jax.Array:
    """One row's tokens x [tokens, d] -> the experts' buffers [experts, capacity, d] (empty
    slots zero)."""
    return jnp.where(routing.filled[..., None], x[routing.source], 0)


def combine(expert_out: jax.Array, routing: Routing, top_k: int) -> jax.Array:
    """The experts' outputs [experts, capacity, d] of one row -> float32 [tokens, d]: each token's
    kept choices' outputs, weighted by their router weights; a dropped choice adds nothing."""
    experts, capacity, d = expert_out.shape
    kept = routing.slot < capacity
    flat = routing.expert * capacity + jnp.minimum(routing.slot, capacity - 1)
    outputs = expert_out.reshape(experts * capacity, d)[flat].astype(jnp.float32)
    weighted = outputs * jnp.where(kept, routing.weight, 0.0)[:, None]
    return jnp.sum(weighted.reshape(top_k, -1, d), axis=0)


def grouped_swiglu(x: jax.Array, expert: jax.Array, weight: jax.Array, real: jax.Array,
                   gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """Dropless: tokens x [batch, tokens, d], their assignments (expert, weight, real: [batch,
    tokens, top_k]) and the stacked expert weights -> float32 [batch, tokens, d], every
    assignment through its expert. Padding's assignments sort last, past every group, where
    `ragged_dot` writes zeros."""
    batch, tokens, d = x.shape
    top_k, experts = expert.shape[-1], gate.shape[0]
    # Token-major: assignment i is token i // top_k's (its (i % top_k)-th choice).
    group = jnp.where(real, expert, experts).reshape(-1)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.bincount(group, length=experts + 1)[:experts].astype(jnp.int32)
    rows = x.reshape(batch * tokens, d)[order // top_k]
    hidden = (jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes))
              * jax.lax.ragged_dot(rows, up, sizes))
    out = jax.lax.ragged_dot(hidden, down, sizes)[jnp.argsort(order)].astype(jnp.float32)
    weighted = out.reshape(batch, tokens, top_k, d) * jnp.where(real, weight, 0.0)[..., None]
    return jnp.sum(weighted, axis=2)


def router_stats(logits: jax.Array, probs: jax.Array, routing: Routing,
                 valid: jax.Array) -> RouterStats:
    """One layer's statistics over the real tokens of the whole batch (`valid` bool
    [batch, tokens]): logits, probs [batch, tokens, experts]; `routing` batched over the rows."""
    experts = logits.shape[-1]
    real = routing.real.reshape(-1)
    assignments = jnp.maximum(jnp.sum(real), 1)
    tokens = jnp.maximum(jnp.sum(valid), 1)
    load = jnp.bincount(routing.expert.reshape(-1), weights=real.astype(jnp.float32),
                        length=experts) / assignments
    # The load is a count (no gradient): the loss pushes on the mean probabilities, which move
    # the routing the same way, towards experts that get less than their share.
    mean_probs = jnp.sum(jnp.where(valid[..., None], probs, 0), axis=(0, 1)) / tokens
    aux = experts * jnp.sum(load * mean_probs)
    z = jnp.sum(jnp.where(valid, jnp.square(jax.nn.logsumexp(logits, axis=-1)), 0)) / tokens
    dropped = (jnp.sum(real) - jnp.sum(routing.filled)) / assignments  # exactly 0 when none
    return RouterStats(aux, z, dropped.astype(jnp.float32), load.astype(jnp.float32))


class MoE(nnx.Module):
    """`cfg.experts` SwiGLU feed-forwards behind a float32 top-k router:
    x -> (output like x, RouterStats)."""

    def __init__(self, d_model: int, mlp_dim: int, cfg: MoEConfig, out_stddev: float,
                 dtype: jnp.dtype, rngs: nnx.Rngs, lora: LoraConfig | None = None):
        e = cfg.experts
        # The router has no `experts` axis: each device scores its own tokens against every expert.
        self.router = param(rngs, (d_model, e), ("embed", None), 0.02)
        self.gate = param(rngs, (e, d_model, mlp_dim), ("experts", "embed", "mlp"), 0.02)
        self.up = param(rngs, (e, d_model, mlp_dim), ("experts", "embed", "mlp"), 0.02)
        self.down = param(rngs, (e, mlp_dim, d_model), ("experts", "mlp", "embed"), out_stddev)
        # LoRA: one adapter per expert, stacked on the `experts` axis with its weight.
        self.gate_lora, self.up_lora, self.down_lora = (
            adapter(lora, name, getattr(self, name), 1, rngs, batch=1)
            for name in ("gate", "up", "down"))
        self.cfg = cfg
        self.dtype = dtype

    def __call__(self, x: jax.Array, valid: jax.Array | None = None,
                 dropless: bool = False) -> tuple[jax.Array, RouterStats]:
        """x [batch, tokens, d_model] in the compute dtype; `valid` (bool [batch, tokens], default
        all) marks the real tokens, padding being neither routed nor counted. `dropless` (or
        capacity_factor 0) drops nothing: decoding uses it (one new token per row, or a prompt),
        where a dropped choice would make the output depend on the batch."""
        cfg = self.cfg
        dropless = dropless or cfg.capacity_factor == 0
        # Dropless routes with a slot for every token of the row: nothing counts as dropped.
        capacity = x.shape[1] if dropless else cfg.capacity(x.shape[1])
        if valid is None:
            valid = jnp.ones(x.shape[:2], bool)
        logits = weight_matmul("btd,de->bte", x.astype(jnp.float32), self.router[...])
        probs = jax.nn.softmax(logits, axis=-1)
        routing = jax.vmap(functools.partial(route, top_k=cfg.top_k, capacity=capacity))(
            probs, valid=valid)
        if dropless:
            out = self.grouped_experts(x, routing)
            return out.astype(x.dtype), router_stats(logits, probs, routing, valid)
        # Dispatch and combine stay with the rows; the experts run where their weights are
        # (with an expert mesh axis, an all-to-all each way: jaxscale/parallel/experts.py).
        buffers = to_experts(jax.vmap(dispatch)(x, routing), BUFFERS)
        expert_out = to_tokens(self.experts(buffers), BUFFERS)
        out = jax.vmap(functools.partial(combine, top_k=cfg.top_k))(expert_out, routing)
        return out.astype(x.dtype), router_stats(logits, probs, routing, valid)

    def weight_dtypes(self) -> dict[str, jnp.dtype]:
        """The experts' weights (by attribute) and the dtype each is cast to where it is used;
        the router stays float32."""
        return dict.fromkeys(("gate", "up", "down"), self.dtype)

    def weight(self, name: str) -> jax.Array:
        """The stacked experts' weight `name` in the compute dtype, each expert's adapter folded
        in (W + (alpha / r) A B) when it has one. Folded, not run beside it as the dense layers'
        are: both dispatch paths take whole weights (the buffers' batched matmuls, the grouped
        matmuls, the weights brought to the tokens' devices); the fold costs a rank-r product and
        a float32 temporary the size of the weight, per layer and use."""
        weight = getattr(self, name)[...]
        lora = getattr(self, f"{name}_lora")
        if lora is not None:
            weight = weight + lora.change(weight.shape)
        return weight.astype(self.dtype)

    def experts(self, buffers: jax.Array) -> jax.Array:
        """Every expert's SwiGLU on its buffers [batch, experts, capacity, d_model] (in the
        expert layout): one batched matmul per weight, over the stacked experts."""
        gate = weight_matmul("becd,edf->becf", buffers, self.weight("gate"))
        up = weight_matmul("becd,edf->becf", buffers, self.weight("up"))
        hidden = constrain_experts(jax.nn.silu(gate) * up, ("batch", "experts", None, "mlp"))
        return weight_matmul("becf,efd->becd", hidden, self.weight("down"))

    def grouped_experts(self, x: jax.Array, routing: Routing) -> jax.Array:
        """Dropless: every assignment of x [batch, tokens, d_model] through its expert, on each
        device's own tokens (`grouped_swiglu`) -> float32 [batch, tokens, d_model]."""
        k = self.cfg.top_k
        # Routing is choice-major per row; the grouped matmuls take [batch, tokens, top_k].
        def per_token(a):
            return jnp.swapaxes(a.reshape(a.shape[0], k, -1), 1, 2)
        tokens = (x, per_token(routing.expert), per_token(routing.weight), per_token(routing.real))
        weights = tuple(self.weight(name) for name in ("gate", "up", "down"))
        return on_token_shards(grouped_swiglu, tokens, weights)
