"""The train step compiled ahead of time for a mesh, with abstract inputs (nothing allocated),
and what the compiler says it needs per device."""

from __future__ import annotations

import dataclasses
import tempfile

import jax
import ml_collections

from jaxscale.plan.chips import GIB  # noqa: F401 - re-exported: callers size memory with it
from jaxscale.step import BATCH_KEYS


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device of the compiled train step, from XLA's buffer assignment
    (`memory_analysis()`), in the device's memory: XLA reports buffers placed in host memory
    (offloaded optimizer state on GPUs and TPUs) apart, in its `host_*` figures."""
    arguments: int  # the train state and the batch
    outputs: int  # the new state (donated: it reuses the arguments' buffers)
    aliased: int  # outputs that reuse argument buffers
    temporaries: int  # everything the step allocates while it runs
    code: int

    @property
    def total(self) -> int:
        """Bytes the step needs on a device: its inputs, its outputs that do not reuse an input's
        buffer, and its working memory (MaxText's `train_compile` sums the same; code excluded)."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def line(self) -> str:
        """The breakdown, in GiB per device (3 significant digits: CPU test models are small)."""
        return (f"arguments {self.arguments / GIB:.3g} GiB, outputs {self.outputs / GIB:.3g} GiB "
                f"({self.aliased / GIB:.3g} of them in the donated arguments' buffers), "
                f"temporaries {self.temporaries / GIB:.3g} GiB, total {self.total / GIB:.3g} GiB")


def abstract_batch(trainer) -> dict[str, jax.ShapeDtypeStruct]:
    t = trainer.config.train
    dtypes = {"loss_mask": jax.numpy.float32}
    return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtypes.get(k, jax.numpy.int32),
                                    sharding=trainer.batch_sharding) for k in BATCH_KEYS}


def compile_train_step(config: ml_collections.ConfigDict,
                       devices) -> tuple[jax.stages.Compiled, StepMemory]:
    """The train step of `config` compiled for `devices` (real, or a TPU topology's), and its
    memory per device."""
    from jaxscale.trainer import Trainer  # the trainer imports the whole stack; only needed here
    with tempfile.TemporaryDirectory() as workdir:
        return Trainer(config, workdir, devices=devices).compile_train_step()


# The statuses with which XLA refuses a program for good: it does not fit the device's memory, or the
# backend cannot build it (an invalid or unsupported program, an unknown topology). Any other
# error is a bug or a broken machine, and must not read as "this layout does not fit".
_REFUSALS = ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT", "UNIMPLEMENTED")


def refused_by_xla(error: Exception) -> bool:
    """Whether `error` is XLA refusing a program (out of memory, invalid, unsupported), which the
    planner records as that candidate's verdict; every other error propagates."""
    return (isinstance(error, jax.errors.JaxRuntimeError)
            and str(error).lstrip().startswith(_REFUSALS))


def step_memory(compiled: jax.stages.Compiled) -> StepMemory:
    m = compiled.memory_analysis()
    return StepMemory(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                      aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
                      code=m.generated_code_size_in_bytes)
