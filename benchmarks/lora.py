"""LoRA against full fine-tuning: optimizer state and memory per chip of the compiled train step
of `configs/llama_1b.py` on a TPU v5p:2x2x1 (4 chips, compiled with libtpu; no TPU needed),
fsdp=4, 2 x 2048 tokens per chip, `model.remat=full`, bfloat16 compute; LoRA at rank 16 on
q k v o gate up down (`model.lora`), everything else the same on both sides; rank 8 is printed
too (the adapters, so their state, grow linearly with the rank).

    pip install -e '.[tpu]'
    python benchmarks/lora.py [--config.KEY=VALUE ...]     # overrides apply to both sides

The optimizer state per chip is read from the compiled program: each Adam moment's shape as the
program's input sharding cuts it, in its dtype, summed. Each side also prints its parameters per
chip (the same way) and the step's memory per chip (`memory_analysis()`). The last line is
`ratio: X` = LoRA's optimizer state / full fine-tuning's, per chip; the target (#27) is <= 0.02.
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; nothing runs here

import jax

from jaxscale.checks import checked_mesh
from jaxscale.cli import parse_train_flags
from jaxscale.plan.targets import parse_target, target_devices
from jaxscale.runtime.chips import GIB
from jaxscale.training.program import TrainProgram

TARGET = "v5p:2x2x1"
SETTINGS = ["--config=configs/llama_1b.py", "--config.mesh.data=1", "--config.mesh.fsdp=4",
            "--config.train.batch_size=8", "--config.train.seq_len=2048",
            "--config.model.remat=full"]
SIDES = {"full fine-tuning": "--config.model.lora.rank=0",
         "LoRA rank 16": "--config.model.lora.rank=16",
         "LoRA rank 8": "--config.model.lora.rank=8"}


def bytes_per_chip(abstract, shardings) -> int:
    """What the arrays of `abstract` take on one chip, cut as `shardings` says."""
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)))


def side(flag: str, overrides: list[str]) -> dict[str, float]:
    config, _ = parse_train_flags(["lora", *SETTINGS, flag, *overrides])
    program = TrainProgram(config, checked_mesh(config, target_devices(parse_target(TARGET))))
    compiled, memory = program.compile_train_step()
    state_shardings = compiled.input_shardings[0][0]  # the train state's, as compiled
    abstract = program.abstract_state
    frozen = (0 if abstract.frozen is None
              else bytes_per_chip(abstract.frozen, state_shardings.frozen))
    return dict(optimizer=bytes_per_chip(abstract.opt_state, state_shardings.opt_state),
                trained=bytes_per_chip(abstract.params, state_shardings.params),
                frozen=frozen, total=memory.total, line=memory.line())


def main() -> None:
    overrides = sys.argv[1:]
    print(f"TPU {TARGET} (compiled only): llama_1b, fsdp=4, 2 x 2048 tokens per chip, "
          "remat full, bfloat16 compute")
    results = {}
    for name, flag in SIDES.items():
        r = results[name] = side(flag, overrides)
        print(f"{name:>17}: optimizer state {r['optimizer'] / GIB:.4g} GiB, trained parameters "
              f"{r['trained'] / GIB:.4g} GiB (float32), frozen {r['frozen'] / GIB:.4g} GiB; "
              f"step {r['line']}")
    full, lora = results["full fine-tuning"], results["LoRA rank 16"]
    print(f"memory per chip, LoRA rank 16 / full: {lora['total'] / full['total']:.4f}")
    print(f"optimizer state, LoRA rank 8 / full: "
          f"{results['LoRA rank 8']['optimizer'] / full['optimizer']:.4f}")
    print("ratio below: LoRA's optimizer state per chip / full fine-tuning's (target <= 0.02)")
    print(f"ratio: {lora['optimizer'] / full['optimizer']:.4f}")


if __name__ == "__main__":
    main()
