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
from jaxscale.parallel.sharding import Rules, tree_shardings


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken, skipped ones included
    params: Any  # nested dict of float32 arrays (the master copy)
    opt_state: Any
    loss_scale: jax.Array  # float32 scalar; stays 1 unless compute is float16
    good_steps: jax.Array  # int32 scalar: finite steps since the loss scale last changed


def model_config(config: ml_collections.ConfigDict) -> models.LlamaConfig:
    """The model's config from the run's `model` and `precision` sections."""
    m = config.model
    return models.LlamaConfig(
        vocab_size=m.vocab_size, vocab_multiple=m.vocab_multiple, d_model=m.d_model,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, rope_theta=m.rope_theta, norm_eps=m.norm_eps,
        tie_embeddings=m.tie_embeddings, remat=m.remat, dtype=config.precision.compute_dtype)


class ModelSpec(NamedTuple):
    """What the step needs to know about the model, taken from its abstract (unallocated) form."""
    config: models.LlamaConfig
    graphdef: nnx.GraphDef
    logical_specs: Any  # same tree as params, leaves are PartitionSpecs of logical axis names
    abstract_params: Any  # same tree, leaves are ShapeDtypeStructs
    num_params: int


def model_spec(config: ml_collections.ConfigDict) -> ModelSpec:
    cfg = model_config(config)
    abstract = models.abstract_model(cfg)
    graphdef, state = nnx.split(abstract)
    return ModelSpec(cfg, graphdef, nnx.to_pure_dict(nnx.get_partition_spec(state)),
                     nnx.to_pure_dict(state), models.count_params(abstract))


def init_state(config: ml_collections.ConfigDict, tx: optax.GradientTransformation,
               seed: int) -> TrainState:
    """A fresh state. Call it under `jit` with out_shardings so every array is born sharded."""
    params = nnx.to_pure_dict(nnx.split(models.create_model(model_config(config), seed))[1])
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
