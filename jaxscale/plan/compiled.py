"""The train step compiled ahead of time for a mesh, with abstract inputs (nothing allocated),
and what the compiler says it needs per device; and which compiler errors mean "refused"."""

from __future__ import annotations

import jax
import ml_collections

from jaxscale.checks import checked_mesh
from jaxscale.observe.device_memory import StepMemory
from jaxscale.training.program import TrainProgram


def compile_train_step(config: ml_collections.ConfigDict,
                       devices) -> tuple[jax.stages.Compiled, StepMemory]:
    """The train step of `config` compiled for `devices` (real, or a TPU topology's), and its
    memory per device."""
    return TrainProgram(config, checked_mesh(config, devices)).compile_train_step()


# The statuses with which XLA refuses a program for good: it does not fit the device's memory, or
# the backend cannot build it (an invalid or unsupported program, an unknown topology). Any other
# error is a bug or a broken machine, and must not read as "this layout does not fit".
_REFUSALS = ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNIMPLEMENTED")


def refused_by_xla(error: Exception) -> bool:
    """Whether `error` is XLA refusing a program (out of memory, invalid, unsupported), which the
    planner records as that candidate's verdict; every other error propagates."""
    return (isinstance(error, jax.errors.JaxRuntimeError)
            and str(error).lstrip().startswith(_REFUSALS))
