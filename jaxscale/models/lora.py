"""LoRA: low-rank adapters on the weight matmuls (`model.lora`), the base weights frozen.

A targeted weight W (q, k, v, o of attention; gate, up, down of the dense feed-forward) gets two
trainable factors beside it: A, shaped like W's input dimensions followed by the rank r, and B,
the rank followed by W's output dimensions. The matmul becomes x W + (alpha / r) (x A) B, so the
adapted model is the base model plus a rank-r change of each W. B starts at zero: at step 0 the
adapted model is the base model exactly. A starts normal with the variance of PEFT's default
(Kaiming-uniform with a = sqrt(5): 1 / (3 fan_in)), so the two checkpoints start alike.

Where they live. An adapter is the module `<weight>_lora` (parameters `a`, `b`) beside its
weight, so it is stacked along the blocks' `layers` axis like every block parameter and each
factor's logical axes are its weight's (the rank dimension gets none): whatever rules shard W
over fsdp, tensor or pipeline shard A and B the same way. A factor that lacks the dimension its
weight's storage is split on (B of q has no `embed`) is also split over that data-parallel axis
on another dimension in training (jaxscale/parallel/placement.py `param_specs`; `followed_specs`
names each factor's weight). In a params tree (the pure dicts of `nnx.to_pure_dict`) the
adapters are the entries under a `*_lora` key; `split_adapters` and `join_adapters` take such a
tree apart and back together, which is how the train state holds the adapters as its trainable
`params` and the rest as `frozen`.

A mixture's experts (jaxscale/models/moe.py, `model.moe`): gate, up and down target each MoE
layer's stacked expert weights [experts, ...] as well, one adapter per expert, its factors
stacked on the `experts` axis with the weight (A [experts, *inputs, r], B [experts, r,
*outputs]). The layer folds them into the weights it uses (`Adapter.change`), since its dispatch
takes whole weights; so their input is not dropped out (`check_lora` refuses dropout there). The
router has none. A PEFT folder cannot hold them (jaxscale/hf/peft.py); a merged export can.

Dropout (`model.lora.dropout` p, PEFT's `lora_dropout`): in the train step only, the adapter's
path is (alpha / r) (dropout(x) A) B, each element of x kept with probability 1 - p and scaled by
1 / (1 - p); the base path x W sees x whole. The masks come from keys, not from a stateful
generator (`AdapterDropout`): `dropout_key` makes one per step from `train.seed` and the step (a
resumed run replays them), the step folds in each row's index in the batch, the stack each
layer's global index, the adapter its target. So one device, any microbatch count, any mesh and
any pipeline schedule drop the same elements, and a remat recomputation draws the same masks
again. Context parallelism (`mesh.context` > 1) is the exception: its shards hold the sequence
reordered (jaxscale/parallel/context.py), and a mask follows the position in that order, so
its masks are as deterministic but other than one device's.

What stays as it is: the embedding, the norms, the head, and every weight not targeted are frozen
with the base; evaluation, sampling and export run the whole model (base and adapters), and
`merged` folds the adapters into their weights (W + (alpha / r) A B), which is what a Hugging
Face export writes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the weights an adapter can sit beside
# An MoE layer's experts have these too: one adapter per expert (`Adapter` with `batch` 1).
EXPERT_TARGETS = ("gate", "up", "down")
ADAPTER_SUFFIX = "_lora"  # `q_lora` is the adapter of `q`
_RANK = "z"  # the rank's letter in the adapter's einsums: unused by the layers' own specs


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


# Folded in first, so that the dropout keys stay apart from the init's draws from the same
# `train.seed` (nnx folds its own counter into that key).
_DROPOUT_STREAM = 0x4C6F5241


def dropout_key(seed: int, step: jax.Array) -> jax.Array:
    """The adapters' dropout key for train step `step` of the run seeded `seed`."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM), step)


@dataclasses.dataclass(frozen=True)
class AdapterDropout:
    """Dropout on the adapters' input at `rate`, with one key per row of the batch: a row's mask
    depends on its own key alone, so a pipeline's microbatch of rows draws the masks those rows
    draw in the whole batch."""
    rate: float
    keys: jax.Array  # [batch] typed keys

    @classmethod
    def for_rows(cls, rate: float, key: jax.Array, rows: int) -> AdapterDropout:
        """Row i's key is `key` folded with i."""
        return cls(rate, _fold(key, jnp.arange(rows)))

    def folded(self, data: jax.Array | int) -> AdapterDropout:
        """The same dropout with `data` (a layer's index, a target's) folded into every key."""
        return AdapterDropout(self.rate, _fold(self.keys, data))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [batch, ...] with each element kept with probability 1 - rate, scaled by
        1 / (1 - rate), and the rest zero."""
        keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1 - self.rate, x.shape[1:]))(self.keys)
        return jnp.where(keep, x / (1 - self.rate), jnp.zeros((), x.dtype))


def _fold(keys: jax.Array, data) -> jax.Array:
    """`fold_in` over a [n] vector of keys and/or of data, the other one a scalar."""
    in_axes = tuple(0 if jnp.ndim(a) else None for a in (keys, data))
    return jax.vmap(jax.random.fold_in, in_axes)(keys, data)


class Adapter(nnx.Module):
    """The factors A [*batch, *inputs, rank] and B [*batch, rank, *outputs] of one weight, whose
    first `batch` dimensions are stacked weights each with its own adapter (a mixture's experts)
    and whose next `inputs` dimensions are the ones its matmul contracts."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str, ...], inputs: int,
                 cfg: LoraConfig, rngs: nnx.Rngs, target: str, batch: int = 0):
        lead, fan_in = shape[:batch], math.prod(shape[batch:batch + inputs])
        a_init = jax.nn.initializers.normal(1 / math.sqrt(3 * fan_in))
        self.a = nnx.Param(a_init(rngs.params(), shape[:batch + inputs] + (cfg.rank,),
                                  jnp.float32),
                           out_sharding=axes[:batch + inputs] + (None,))
        self.b = nnx.Param(jnp.zeros(lead + (cfg.rank,) + shape[batch + inputs:], jnp.float32),
                           out_sharding=axes[:batch] + (None,) + axes[batch + inputs:])
        self.inputs = inputs
        self.scale = cfg.scale
        self.target = TARGETS.index(target)  # folded into its dropout keys: a mask of its own

    def change(self, shape: tuple[int, ...]) -> jax.Array:
        """(alpha / r) A B in float32, shaped like the weight (`shape`), one product per stacked
        weight: what a weight the matmul takes whole (an expert's) adds to itself."""
        return _low_rank_product(self.a[...], self.b[...], shape, self.scale)

    def __call__(self, spec: str, x: jax.Array, matmul, grad_dtype: jnp.dtype,
                 dropout: AdapterDropout | None = None) -> jax.Array:
        """(alpha / r) (x A) B for the weight matmul `spec` ("btd,dnh->btnh"), each product made
        by `matmul` (the layers' `weight_matmul`, so the gradients' dtypes and the remat names
        are the weight's own); x through `dropout` first when given (training)."""
        if dropout is not None:
            x = dropout.folded(self.target)(x)
        x_axes, rest = spec.split(",")
        weight_axes, out_axes = rest.split("->")
        contracted = weight_axes[:self.inputs]
        kept = "".join(a for a in x_axes if a not in contracted)
        low = matmul(f"{x_axes},{contracted}{_RANK}->{kept}{_RANK}", x,
                     self.a[...].astype(grad_dtype))
        # The scale rides on B, so the rank-r product is not rescaled at full width.
        return matmul(f"{kept}{_RANK},{_RANK}{weight_axes[self.inputs:]}->{out_axes}", low,
                      (self.b[...] * self.scale).astype(grad_dtype))


def adapter(cfg: LoraConfig | None, name: str, weight: nnx.Param, inputs: int,
            rngs: nnx.Rngs, batch: int = 0) -> Adapter | None:
    """The adapter of weight `name` when `cfg` targets it, else None; `batch` leading dimensions
    of the weight (the experts) get one adapter each."""
    if cfg is None or name not in cfg.targets:
        return None
    return Adapter(weight.shape, tuple(weight.out_sharding), inputs, cfg, rngs, name, batch)


def split_adapters(tree: dict) -> tuple[dict, dict]:
    """(the adapters, the rest) of a params-shaped nested dict (parameters, their logical specs,
    shardings or shapes): the entries under `*_lora` keys, and the others."""
    adapters, rest = {}, {}
    for key, value in tree.items():
        if str(key).endswith(ADAPTER_SUFFIX):
            adapters[key] = value
        elif isinstance(value, dict):
            inner_adapters, inner_rest = split_adapters(value)
            if inner_adapters:
                adapters[key] = inner_adapters
            if inner_rest:
                rest[key] = inner_rest
        else:
            rest[key] = value
    return adapters, rest


def followed_specs(logical_specs: dict) -> dict:
    """For each entry of a params-shaped tree of logical PartitionSpecs, the logical spec of the
    parameter whose storage it follows in training (jaxscale/parallel/placement.py
    `param_specs`): an adapter factor (`q_lora/a`, `q_lora/b`) its weight's (`q`), every other
    parameter its own."""
    followed = {}
    for key, value in logical_specs.items():
        if str(key).endswith(ADAPTER_SUFFIX):
            weight = logical_specs[str(key).removesuffix(ADAPTER_SUFFIX)]
            followed[key] = jax.tree.map(lambda _: weight, value,
                                         is_leaf=lambda x: isinstance(x, P))
        elif isinstance(value, dict):
            followed[key] = followed_specs(value)
        else:
            followed[key] = value
    return followed


def join_adapters(adapters: dict, rest: dict) -> dict:
    """The tree `split_adapters` took apart."""
    joined = dict(rest)
    for key, value in adapters.items():
        joined[key] = join_adapters(value, rest[key]) if key in rest else value
    return joined


def merged(params: dict, cfg: LoraConfig) -> dict:
    """The params without adapters, each targeted weight W replaced by W + (alpha / r) A B (per
    layer for stacked weights), in float32."""
    out = {}
    for key, value in params.items():
        if str(key).endswith(ADAPTER_SUFFIX):
            continue
        if isinstance(value, dict):
            out[key] = merged(value, cfg)
            continue
        lora = params.get(f"{key}{ADAPTER_SUFFIX}")
        out[key] = value if lora is None else value + low_rank_change(lora, value.shape, cfg)
    return out


def low_rank_change(lora: dict, shape: tuple[int, ...], cfg: LoraConfig) -> jax.Array:
    """(alpha / r) A B for an adapter {a, b}, shaped like its weight (`shape`)."""
    return _low_rank_product(lora["a"], lora["b"], shape, cfg.scale)


def _low_rank_product(a, b, shape: tuple[int, ...], scale: float) -> jax.Array:
    """scale A B in float32, shaped like the weight (`shape`): the leading dimensions that both
    factors have beside the weight's own (the stacked `layers`, a mixture's `experts`) are kept,
    one product each, not multiplied across."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    rank = a.shape[-1]
    lead = a.shape[:a.ndim + b.ndim - 2 - len(shape)]
    a2 = a.reshape(lead + (-1, rank))
    b2 = b.reshape(lead + (rank, -1))
    return (scale * jnp.matmul(a2, b2)).reshape(shape)


def lora_config(rank: int, alpha: float, targets) -> LoraConfig | None:
    """`model.lora` as the model takes it: None when off (rank 0)."""
    return LoraConfig(rank, float(alpha), tuple(targets)) if rank else None


def check_lora(config) -> None:
    """ConfigError for `model.lora` settings the adapters cannot honour (config: the run's)."""
    lora = config.model.lora
    if not lora.rank:
        return
    targets = tuple(lora.targets)
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown or len(set(targets)) != len(targets):
        raise ConfigError(f"model.lora.targets={targets!r}: name each weight once, among "
                          f"{TARGETS}")
    on_experts = [t for t in targets if t in EXPERT_TARGETS]
    if config.model.moe.every and on_experts and lora.dropout:
        raise ConfigError(f"model.lora.dropout={lora.dropout} with adapters on the experts "
                          f"({on_experts}, model.moe.every={config.model.moe.every}): an expert's "
                          "adapter is folded into its weight, which sees x undropped; use "
                          "model.lora.dropout=0 or targets among ('q', 'k', 'v', 'o')")
    if config.precision.matmul != "bfloat16":
        raise ConfigError(f"model.lora with precision.matmul={config.precision.matmul!r}: "
                          "adapters run in the compute dtype beside bfloat16 weights only; use "
                          "precision.matmul='bfloat16' or model.lora.rank=0")
