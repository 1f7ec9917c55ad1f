"""The train state (parameters, optimizer state, counters) and its init; where it lives:
jaxscale/training/layout.py."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.models.fp8 import Fp8Meta
from jaxscale.models.lora import join_adapters, split_adapters
from jaxscale.models.spec import create_model, model_config


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: steps taken, skipped ones included; the schedule's position
    # nested dict of float32 arrays (the master copy) of the trained parameters: all of them, or
    # with LoRA the adapters alone (`frozen` holds the rest)
    params: Any
    opt_state: Any
    loss_scale: jax.Array  # float32 scalar; stays 1 unless compute is float16
    good_steps: jax.Array  # int32 scalar: finite steps since the loss scale last changed
    # precision.matmul='fp8': the fp8 matmuls' scales and amax histories (a nested dict beside
    # params, jaxscale/models/fp8.py); None otherwise.
    fp8: Any = None
    # model.lora: the frozen base parameters (in the compute dtype), which no step changes and
    # no checkpoint holds (the base is named by the config); None without LoRA.
    frozen: Any = None

    def model_params(self) -> Any:
        """Every parameter of the model (base and adapters): what evaluation and sampling run."""
        return self.params if self.frozen is None else join_adapters(self.params, self.frozen)


def init_state(config: ml_collections.ConfigDict, tx: optax.GradientTransformation,
               seed: int) -> TrainState:
    """A fresh state. Call it under `jit` with out_shardings so every array is born sharded.
    With LoRA the base is frozen in the compute dtype: it needs no float32 master, never being
    updated."""
    _, params, fp8 = nnx.split(create_model(model_config(config), seed), nnx.Param, Fp8Meta)
    params, fp8, frozen = nnx.to_pure_dict(params), nnx.to_pure_dict(fp8) or None, None
    if config.model.lora.rank:
        params, frozen = split_adapters(params)
        frozen = jax.tree.map(lambda x: x.astype(config.precision.compute_dtype), frozen)
    loss_scale = config.precision.loss_scale_init if uses_dynamic_loss_scale(config) else 1.0
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      loss_scale=jnp.asarray(loss_scale, jnp.float32),
                      good_steps=jnp.zeros((), jnp.int32), fp8=fp8, frozen=frozen)


def placed(abstract_state: TrainState, tx: optax.GradientTransformation,
           shardings: Any) -> TrainState:
    """A TrainState of shardings for `abstract_state` (`jax.eval_shape` of `init_state` with
    `tx`) from `shardings`, a StateLayout on a mesh (jaxscale/training/layout.py
    `StateShardings`): each optimizer moment as its parameter's entry of `stored_moments`,
    scalars replicated."""
    replicated = NamedSharding(shardings.mesh, P())
    opt_state = optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_state.opt_state, shardings.stored_moments,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=shardings.trained, opt_state=opt_state,
                      loss_scale=replicated, good_steps=replicated, fp8=shardings.fp8,
                      frozen=shardings.frozen)


def uses_dynamic_loss_scale(config: ml_collections.ConfigDict) -> bool:
    """float16 compute needs a loss scale that adapts to overflows; wider dtypes need none."""
    return config.precision.compute_dtype == "float16"


def logical_axis_sizes(config: ml_collections.ConfigDict) -> dict[str, int]:
    """The length of each logical axis under `config`, which must divide its mesh axes."""
    m, t = config.model, config.train
    return dict(
        batch=t.batch_size // max(t.microbatches, 1),  # what one microbatch shards
        length=t.seq_len,
        embed=m.d_model,
        heads=m.n_heads,
        kv_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        mlp=m.mlp_dim,
        vocab=model_config(config).padded_vocab_size,
        layers=m.n_layers,
        experts=m.moe.experts,
    )
