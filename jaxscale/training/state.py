"""The train state (parameters, optimizer state, counters), its shardings, and its sharded init."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxscale.models.fp8 import Fp8Meta
from jaxscale.models.lora import followed_specs, join_adapters, split_adapters
from jaxscale.models.spec import ModelSpec, create_model, model_config, model_spec
from jaxscale.parallel.placement import moment_specs, param_specs, streamed_slices
from jaxscale.parallel.sharding import Rules, rules_from_config


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


def uses_dynamic_loss_scale(config: ml_collections.ConfigDict) -> bool:
    """float16 compute needs a loss scale that adapts to overflows; wider dtypes need none."""
    return config.precision.compute_dtype == "float16"


class StateSpecs(NamedTuple):
    """Where the train state lives on a mesh, as PartitionSpecs over its axes (`state_specs`)."""
    params: Any  # every parameter of the model, base and adapters
    moments: Any  # each trained parameter's optimizer moments, and its gradient before the update
    # each trained parameter: in how many slices the update of offloaded moments streams it
    slices: Any


def state_specs(spec: ModelSpec, rules: Rules, mesh_shape: Mapping[str, int],
                layout: str) -> StateSpecs:
    """Where the parameters and optimizer moments of `spec`'s model live on a mesh of
    `mesh_shape` under `rules`, with the moments' `layout` (sharding.optimizer_state: 'params',
    or 'data' for ZeRO-1), and the slices their offloaded update streams in
    (jaxscale/parallel/placement.py). With LoRA each adapter factor is placed like its weight,
    and the moments and slices are the adapters' alone. ConfigError when 'data' cannot split a
    parameter's moments."""
    logical, shapes = spec.logical_specs, spec.abstract_params
    followed = followed_specs(logical)  # each LoRA factor's storage follows its weight's
    params = param_specs(logical, shapes, followed, rules, mesh_shape)
    trained = [spec.trained(tree) for tree in (logical, shapes, params)]
    moments = moment_specs(*trained, rules, mesh_shape, layout)
    return StateSpecs(params, moments, streamed_slices(*trained, moments, mesh_shape))


def state_shardings(abstract_state: TrainState, param_shardings: Any, moments: Any,
                    tx: optax.GradientTransformation, mesh: Mesh,
                    fp8_shardings: Any = None, frozen_shardings: Any = None) -> TrainState:
    """Parameters as `param_shardings`; each optimizer moment as its parameter's entry of
    `moments` (`StateSpecs.moments`); the fp8 meta as `fp8_shardings`, the frozen base as
    `frozen_shardings`; scalars replicated."""
    replicated = NamedSharding(mesh, P())
    opt_shardings = optax.tree_map_params(
        tx, lambda _, sharding: sharding, abstract_state.opt_state, moments,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                      loss_scale=replicated, good_steps=replicated, fp8=fp8_shardings,
                      frozen=frozen_shardings)


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


def check_optimizer_layout(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """ConfigError when sharding.optimizer_state='data' (ZeRO-1) cannot split every parameter's
    moments over the data axes of `mesh_shape` (checked on the model's shapes)."""
    layout = config.sharding.optimizer_state
    if layout == "data":
        state_specs(model_spec(config), rules_from_config(config.sharding.rules), mesh_shape,
                    layout)
