"""Where the train state lives: `StateLayout`, built once per program from the model's abstract
form, the sharding rules, the mesh's shape and the optimizer's settings. TrainProgram places the
state by it, the planner's memory model counts bytes from it (its PartitionSpecs need no devices),
and the checkpoint restores into the abstract state TrainProgram makes from it.

    layout = StateLayout(model, rules, mesh_shape, optimizer_state="params", offload=False)
    layout.params, layout.moments, layout.slices, layout.fp8     # PartitionSpecs; slice counts
    shardings = layout.on(mesh)                                   # the same as NamedShardings

The parameters are every parameter of the model, base and adapters; with LoRA each adapter
factor is placed like its weight (jaxscale/models/lora.py `followed_specs`), and the moments and
slices are the trained parameters' alone (the adapters'). How each is placed:
jaxscale/parallel/placement.py.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import ml_collections
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxscale.models.lora import followed_specs
from jaxscale.models.spec import ModelSpec, model_spec
from jaxscale.parallel.placement import moment_specs, param_specs, streamed_slices
from jaxscale.parallel.sharding import Rules, logical_to_mesh, mesh_shardings, rules_from_config
from jaxscale.training import offload as host_offload


class StateLayout:
    """The PartitionSpecs (over a mesh's axes) of the train state's arrays on a mesh of
    `mesh_shape` under `rules`: `params` (every parameter), `moments` (each trained parameter's
    optimizer moments, and its gradient before the update: with `optimizer_state` 'data', ZeRO-1,
    also split over the data-parallel axes), `slices` (in how many slices the update of
    `offload`ed moments streams each trained parameter) and `fp8` (the fp8 meta's; None
    without). ConfigError when 'data' cannot split a parameter's moments."""

    def __init__(self, model: ModelSpec, rules: Rules, mesh_shape: Mapping[str, int],
                 optimizer_state: str, offload: bool):
        self.model, self.rules, self.offload = model, rules, offload
        logical, shapes = model.logical_specs, model.abstract_params
        self.params = param_specs(logical, shapes, followed_specs(logical), rules, mesh_shape)
        trained = [model.trained(tree) for tree in (logical, shapes, self.params)]
        self.moments = moment_specs(*trained, rules, mesh_shape, optimizer_state)
        self.slices = streamed_slices(*trained, self.moments, mesh_shape)
        self.fp8 = None if model.fp8_specs is None else jax.tree.map(
            lambda names: logical_to_mesh(names, rules), model.fp8_specs,
            is_leaf=lambda x: isinstance(x, P))

    @classmethod
    def of(cls, config: ml_collections.ConfigDict, mesh_shape: Mapping[str, int],
           model: ModelSpec | None = None) -> StateLayout:
        """The layout of `config`'s run on a mesh of `mesh_shape` (`model`: its model_spec)."""
        return cls(model or model_spec(config), rules_from_config(config.sharding.rules),
                   mesh_shape, config.sharding.optimizer_state, config.optim.offload_state)

    def on(self, mesh: Mesh) -> StateShardings:
        """The layout as NamedShardings on `mesh` (whose shape it was made for)."""
        params = mesh_shardings(self.params, mesh)
        moments = mesh_shardings(self.moments, mesh)
        return StateShardings(
            mesh, params, moments,
            host_offload.on_host(moments) if self.offload else moments,
            None if self.fp8 is None else mesh_shardings(self.fp8, mesh),
            self.model.trained(params), self.model.frozen(params))


class StateShardings(NamedTuple):
    """A `StateLayout` on a mesh (`StateLayout.on`); jaxscale/training/state.py `placed` makes
    the train state's shardings of it."""
    mesh: Mesh
    params: Any  # every parameter's: what evaluation and sampling read
    moments: Any  # each trained parameter's moments on the device: where its gradient is reduced
    stored_moments: Any  # where the moments are kept: `moments`, or in host memory (offloaded)
    fp8: Any  # None without fp8
    trained: Any  # TrainState.params: `params`, or with LoRA the adapters'
    frozen: Any  # TrainState.frozen: with LoRA the base's; None without


def check_optimizer_layout(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """ConfigError when sharding.optimizer_state='data' (ZeRO-1) cannot split every parameter's
    moments over the data axes of `mesh_shape` (the layout of the model's shapes, which
    model_spec makes once per model config: the program asks for the same)."""
    if config.sharding.optimizer_state == "data":
        StateLayout.of(config, mesh_shape)
