"""The train state (parameters, optimizer state, counters), its shardings, and its sharded init."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale import models
from jaxscale.sharding import Rules, tree_shardings


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken, skipped ones included
    params: Any  # nested dict of float32 arrays (the master copy)
    opt_state: Any
    loss_scale: jax.Array  # float32 scalar; stays 1 unless compute is float16
    good_steps: jax.Array  # int32 scalar: finite steps since the loss scale last changed


class ModelSpec(NamedTuple):
    """What the step needs to know about the model, taken from its abstract (unallocated) form."""
    graphdef: nnx.GraphDef
    logical_specs: Any  # same tree as params, leaves are PartitionSpecs of logical axis names
    abstract_params: Any  # same tree, leaves are ShapeDtypeStructs
    num_params: int


def model_spec(config: ml_collections.ConfigDict) -> ModelSpec:
    abstract = models.abstract_model(config)
    graphdef, state = nnx.split(abstract)
    return ModelSpec(graphdef, nnx.get_partition_spec(state).to_pure_dict(),
                     state.to_pure_dict(), models.count_params(abstract))


def init_state(config: ml_collections.ConfigDict, tx: optax.GradientTransformation,
               seed: int) -> TrainState:
    """A fresh state. Call it under `jit` with out_shardings so every array is born sharded."""
    params = nnx.split(models.create_model(config, seed))[1].to_pure_dict()
    loss_scale = config.precision.loss_scale_init if uses_dynamic_loss_scale(config) else 1.0
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      loss_scale=jnp.asarray(loss_scale, jnp.float32),
                      good_steps=jnp.zeros((), jnp.int32))


def uses_dynamic_loss_scale(config: ml_collections.ConfigDict) -> bool:
    """float16 compute needs a loss scale that adapts to overflows; wider dtypes need none."""
    return config.precision.compute_dtype == "float16"


def state_shardings(abstract_state: TrainState, spec: ModelSpec, tx: optax.GradientTransformation,
                    mesh: Mesh, rules: Rules) -> TrainState:
    """Parameters follow the rules; optimizer moments follow their parameters; scalars replicate."""
    replicated = NamedSharding(mesh, P())
    param_shardings = tree_shardings(spec.logical_specs, mesh, rules)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_state.opt_state, param_shardings,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                      loss_scale=replicated, good_steps=replicated)
