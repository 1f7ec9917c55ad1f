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
    """Bytes per device of the compiled train step, from XLA's buffer assignment."""
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
        return (f"arguments {self.arguments / GIB:.2f} GiB, temporaries "
                f"{self.temporaries / GIB:.2f} GiB, total {self.total / GIB:.2f} GiB per device")


def abstract_batch(trainer) -> dict[str, jax.ShapeDtypeStruct]:
    t = trainer.config.train
    dtypes = {"loss_mask": jax.numpy.float32}
    return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtypes.get(k, jax.numpy.int32),
                                    sharding=trainer.batch_sharding) for k in BATCH_KEYS}


def compile_train_step(config: ml_collections.ConfigDict, devices) -> jax.stages.Compiled:
    """The train step of `config` compiled for `devices` (real, or a TPU topology's)."""
    from jaxscale.trainer import Trainer  # the trainer imports the whole stack; only needed here
    with tempfile.TemporaryDirectory() as workdir:
        compiled, _ = Trainer(config, workdir, devices=devices).compile_train_step()
        return compiled


def step_memory(compiled: jax.stages.Compiled) -> StepMemory:
    m = compiled.memory_analysis()
    return StepMemory(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                      aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
                      code=m.generated_code_size_in_bytes)
