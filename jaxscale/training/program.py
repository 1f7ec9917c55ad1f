"""A config's training program on a mesh: what the trainer runs and the planner compiles.

    program = TrainProgram(config, mesh)         # nothing compiled, nothing allocated
    compiled, memory = program.compile_train_step()
    program, compiled, memory = program.compile_fitting_step(capacity)   # leaner if need be

The step settings the config leaves to the device (jaxscale/training/step_settings.py) are set
to the device's first choice; `compile_fitting_step` moves on to its next choices while the
compiled step does not fit. From the config and the mesh it then builds, in order: the model's
abstract form, where every array of the train state lives (jaxscale/training/layout.py), the
optimizer, the abstract train state that a checkpoint is restored into, and the jitted init,
train and eval steps with those shardings. The trainer (jaxscale/trainer.py) adds the workdir,
the data, checkpoints and the loop; the planner (jaxscale/plan/) compiles a program per
candidate layout for devices it may not have.
"""

from __future__ import annotations

import functools

import jax
import ml_collections
from jax.sharding import Mesh

from jaxscale.models.spec import model_spec
from jaxscale.observe.device_memory import StepMemory, step_memory
from jaxscale.parallel.pipeline import config_pipeline
from jaxscale.parallel.sharding import batch_sharding, with_rules
from jaxscale.training import step_settings
from jaxscale.training.layout import StateLayout
from jaxscale.training.optim import make_optimizer
from jaxscale.training.state import init_state, placed
from jaxscale.training.step import BATCH_KEYS, Objective, make_eval_step, make_train_step


class TrainProgram:
    """The train and eval steps of `config` on `mesh`, jitted with their shardings (the config
    checked for the mesh's devices first: jaxscale.checks.checked_mesh)."""

    def __init__(self, config: ml_collections.ConfigDict, mesh: Mesh,
                 settings: step_settings.StepSettings | None = None):
        """`settings`: one of `choices`, the step settings it runs (default: the first)."""
        # What the device may try, in order, for the keys the config leaves to it.
        self.choices = step_settings.choices(config, mesh.devices.flat[0].platform)
        self.settings = settings or self.choices[0]
        self.requested = config  # as given; `config` is the same with the settings set
        self.config = config = self.settings.apply(config)
        self.mesh = mesh
        self.model = model = model_spec(config)
        # Where every array of the state lives (parameters, moments, the slices offloaded
        # moments stream in, the fp8 meta), made once: the memory model counts the same layout.
        self.layout = layout = StateLayout.of(config, mesh.shape, model)
        self.rules, shardings = layout.rules, layout.on(mesh)
        self.param_shardings = shardings.params
        # With LoRA the optimizer sees the adapters alone (TrainState.params). Offloaded moments
        # stream through its update in slices: the stacked weights' a layer at a time.
        self.tx, self.schedule = make_optimizer(
            config.optim, config.train.steps, model.trained(model.logical_specs), layout.slices)
        init = functools.partial(init_state, config, self.tx)
        abstract_state = jax.eval_shape(init, 0)
        self.state_shardings = placed(abstract_state, self.tx, shardings)
        # What a checkpoint is restored into: this run's shapes and shardings, whatever the mesh
        # that wrote it.
        self.abstract_state = jax.tree.map(
            lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
            abstract_state, self.state_shardings)
        self.init_state = jax.jit(init, out_shardings=self.state_shardings)
        # The steps run the blocks in the mesh's pipeline stages (None: one stage), and are traced
        # with the mesh and rules active, so the model's `constrain` shards its activations.
        # ZeRO-1: each gradient is reduced onto its moments' layout (`grad_shardings`).
        self.pipeline = config_pipeline(config, mesh.shape["pipeline"])
        zero1 = config.sharding.optimizer_state == "data"
        train_step = make_train_step(
            config, Objective.of(config, model.train_graphdef, self.pipeline), self.tx,
            self.schedule, grad_shardings=shardings.moments if zero1 else None)
        eval_step = make_eval_step(Objective.of(config, model.graphdef, self.pipeline))
        self.batch_sharding = batch_sharding(mesh, self.rules)
        batch_shardings = {k: self.batch_sharding for k in BATCH_KEYS}
        self.train_step = jax.jit(
            with_rules(train_step, mesh, self.rules),
            in_shardings=(self.state_shardings, batch_shardings),
            out_shardings=(self.state_shardings, None), donate_argnums=0)
        self.eval_step = jax.jit(with_rules(eval_step, mesh, self.rules),
                                 in_shardings=(self.param_shardings, batch_shardings))

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """A batch's shapes, dtypes and sharding, with nothing allocated: what the step compiles
        for."""
        t = self.config.train
        dtypes = {"loss_mask": jax.numpy.float32}
        return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtypes.get(k, jax.numpy.int32),
                                        sharding=self.batch_sharding) for k in BATCH_KEYS}

    def compile_train_step(self) -> tuple[jax.stages.Compiled, StepMemory]:
        """The train step compiled ahead of time for the abstract state and batch (for the mesh's
        devices, real or a TPU topology's), and what it needs per device."""
        compiled = self.train_step.lower(self.abstract_state, self.abstract_batch()).compile()
        return compiled, step_memory(compiled)

    def compile_fitting_step(self, capacity: int | None
                             ) -> tuple[TrainProgram, jax.stages.Compiled, StepMemory]:
        """(a program, its compiled train step, its memory): this one's, or while a step needs
        more than `capacity` bytes per device (None: unknown, anything fits), the program of
        the next of `choices` (the leanest when none fits, for the caller to refuse). Every
        choice has the same train state, so a checkpoint restored for one serves any."""
        program, index = self, self.choices.index(self.settings)
        while True:
            compiled, memory = program.compile_train_step()
            index += 1
            if capacity is None or memory.total <= capacity or index == len(self.choices):
                return program, compiled, memory
            program = TrainProgram(self.requested, self.mesh, self.choices[index])
