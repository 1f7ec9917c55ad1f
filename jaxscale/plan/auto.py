"""`--config.mesh.auto=True`: the trainer asks the planner for its layout at start-up."""

from __future__ import annotations

import jax
import ml_collections

from jaxscale.errors import ConfigError
from jaxscale.plan import report
from jaxscale.plan.chips import GIB
from jaxscale.plan.planner import make_plan
from jaxscale.plan.targets import local_target

# Candidates compiled at start-up: one that fits is enough to train. The trainer then compiles
# the chosen one again (a second compile: handing the planner's over is still to do).
AUTO_TOP = 1


def planned_config(config: ml_collections.ConfigDict, devices) -> ml_collections.ConfigDict:
    """`config` with the layout the planner chooses for `devices`, after printing the table and
    the choice (process 0); ConfigError naming the shortfall when nothing fits. Every process
    plans alike (same config, same devices, same compiler), so all choose the same layout."""
    def say(line: str) -> None:
        if jax.process_index() == 0:
            print(line, flush=True)

    gib = config.mesh.auto_memory_gib
    if gib < 0:
        raise ConfigError(f"mesh.auto_memory_gib={gib} must be >= 0 (0: the chip's memory)")
    target = local_target(devices)
    say(f"mesh.auto: planning the layout for {len(devices)} {devices[0].device_kind} device(s)")
    plan = make_plan(config, target, top=AUTO_TOP, capacity=int(gib * GIB) or None,
                     devices=devices, log=say)
    say(report.header(plan))
    say(report.table(plan))
    if plan.chosen is None:
        raise ConfigError(f"mesh.auto: {report.no_fit(plan)}")
    say(report.chosen(plan))
    return plan.chosen.candidate.apply(config)
