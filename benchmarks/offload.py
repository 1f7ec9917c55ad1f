"""Offloaded Adam moments streamed through the update against moved to the device all at once:
memory of the compiled train step of `configs/llama3_8b.py` on one TPU v5p chip (compiled with
libtpu; no TPU needed), 1 x 8192 tokens, bfloat16 moments in host memory
(`optim.offload_state=True`), the settings the H100 run in benchmarks/RESULTS.md needed 95% of
its memory for.

    pip install -e '.[tpu]'
    python benchmarks/offload.py [--config=FILE] [--config.KEY=VALUE ...]   # both sides

Both sides are the same program but for the update: "streamed" is the trainer's own (the
moments moved to the device, updated and moved back in slices: the stacked layers' a layer at a
time, the embedding's and the head's a few rows at a time, the final norm's whole:
jaxscale/training/optim.py streamed_update); "all at once" moves the whole optimizer state to the
device before the step, as the trainer did before, and updates every parameter together. Each
prints `memory_analysis()` per chip (the device's bytes; the host's apart). The last line is
`ratio: X` = streamed total / all-at-once total on the device; below 1.0 streaming needs less.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; nothing runs here

import jax

from jaxscale.checks import checked_mesh
from jaxscale.cli import parse_train_flags
from jaxscale.observe.device_memory import step_memory
from jaxscale.parallel.sharding import with_rules
from jaxscale.plan.targets import parse_target, target_devices
from jaxscale.runtime.chips import GIB
from jaxscale.training.optim import make_optimizer
from jaxscale.training.program import TrainProgram
from jaxscale.training.step import BATCH_KEYS, Objective, make_train_step

TARGET = "v5p:2x2x1"  # the smallest v5p topology; its first chip alone
SETTINGS = ["--config=configs/llama3_8b.py", "--config.mesh.data=1", "--config.mesh.fsdp=1",
            "--config.train.batch_size=1", "--config.train.seq_len=8192",
            "--config.optim.moment_dtype=bfloat16", "--config.optim.offload_state=True"]


def all_at_once_step(program: TrainProgram) -> jax.stages.Wrapped:
    """The program's train step with the update it had before streaming: the whole optimizer
    state moved to the device first (the same layout in device memory), then one update of
    every parameter (the optimizer without `offload_state`: the same state, not streamed)."""
    config = program.config
    plain = config.copy_and_resolve_references()
    plain.optim.offload_state = False
    model = program.model
    tx, schedule = make_optimizer(plain.optim, config.train.steps,
                                  model.trained(model.logical_specs))
    objective = Objective.of(config, model.train_graphdef, program.pipeline)
    step = with_rules(make_train_step(config, objective, tx, schedule), program.mesh,
                      program.rules)
    on_device = jax.tree.map(lambda sharding: sharding.with_memory_kind(None),
                             program.state_shardings.opt_state)

    def moved_then_step(state, batch):
        return step(state._replace(opt_state=jax.device_put(state.opt_state, on_device)), batch)

    batch_shardings = {k: program.batch_sharding for k in BATCH_KEYS}
    return jax.jit(moved_then_step, in_shardings=(program.state_shardings, batch_shardings),
                   out_shardings=(program.state_shardings, None), donate_argnums=0)


def main(argv: list[str]) -> None:
    settings = SETTINGS
    if any(a.startswith("--config=") for a in argv[1:]):  # another model, the same settings
        settings = SETTINGS[1:]
    config, _ = parse_train_flags([argv[0], *settings, *argv[1:]], about=__doc__)
    devices = target_devices(parse_target(TARGET))[:1]
    program = TrainProgram(config, checked_mesh(config, devices))
    print(f"jax {jax.__version__}; one chip of {TARGET} ({devices[0].device_kind}); "
          f"{' '.join(settings + argv[1:])}")
    totals = {}
    for side, jitted in (("streamed", program.train_step),
                         ("all at once", all_at_once_step(program))):
        start = time.perf_counter()
        compiled = jitted.lower(program.abstract_state, program.abstract_batch()).compile()
        memory = step_memory(compiled)
        totals[side] = memory.total
        print(f"{side}: {memory.line()} (compiled in {time.perf_counter() - start:.0f} s)")
    print(f"saved per chip: {(totals['all at once'] - totals['streamed']) / GIB:.2f} GiB")
    print(f"ratio: {totals['streamed'] / totals['all at once']:.4f}")


if __name__ == "__main__":
    main(sys.argv)
