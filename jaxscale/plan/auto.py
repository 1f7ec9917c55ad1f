"""`--config.mesh.auto=True`: the trainer asks the planner for its layout at start-up."""

from __future__ import annotations

import jax
import ml_collections

from jaxscale.device_memory import check_device_memory_gib, device_capacity
from jaxscale.errors import ConfigError
from jaxscale.plan import report
from jaxscale.plan.chips import GIB
from jaxscale.plan.compiled import StepMemory
from jaxscale.plan.planner import make_plan
from jaxscale.plan.targets import local_target

# Candidates compiled at start-up: one that fits is enough to train.
AUTO_TOP = 1


def planned_config(config: ml_collections.ConfigDict, devices
                   ) -> tuple[ml_collections.ConfigDict, tuple[jax.stages.Compiled, StepMemory]]:
    """(`config` with the layout the planner chooses for `devices`, the chosen train step as the
    planner compiled it, with its memory), after printing the table and the choice (process 0);
    ConfigError naming the shortfall when nothing fits. Every process plans alike (same config,
    same devices, same compiler), so all choose the same layout.

    The planner compiles a candidate as a run of `candidate.apply(config)` on `devices` does
    (the local devices are a target it compiles for, so the chosen row is compiled): the very
    step, shardings and donation included, that the trainer would compile next, so the trainer
    takes it instead."""
    def say(line: str) -> None:
        if jax.process_index() == 0:
            print(line, flush=True)

    gib = config.mesh.auto_memory_gib
    if gib < 0:
        raise ConfigError(f"mesh.auto_memory_gib={gib} must be >= 0 (0: the capacity the run's "
                          "memory check uses)")
    check_device_memory_gib(config.performance.device_memory_gib)
    # Without mesh.auto_memory_gib, plan for the capacity the run's memory check will hold the
    # step to (performance.device_memory_gib, else the allocator's limit), else the chip's.
    local = [d for d in devices if d.process_index == jax.process_index()]
    capacity = device_capacity(local, config.performance.device_memory_gib)
    capacity_bytes = int(gib * GIB) if gib else capacity[0] if capacity else None
    target = local_target(devices)
    say(f"mesh.auto: planning the layout for {len(devices)} {devices[0].device_kind} device(s)")
    plan = make_plan(config, target, top=AUTO_TOP, capacity=capacity_bytes, devices=devices,
                     log=say)
    say(report.header(plan))
    say(report.table(plan))
    chosen = plan.chosen
    if chosen is None:
        raise ConfigError(f"mesh.auto: {report.no_fit(plan)}")
    say(report.chosen(plan))
    return chosen.candidate.apply(config), (chosen.executable, chosen.compiled)
