"""`--config.mesh.auto=True`: `python -m jaxscale.train` asks the planner for the layout before it
builds the trainer, and hands the trainer the step the planner compiled."""

from __future__ import annotations

import jax
import ml_collections

from jaxscale.config import check_schema
from jaxscale.errors import ConfigError
from jaxscale.observe.device_memory import StepMemory, device_capacity
from jaxscale.parallel.attention import check_attention
from jaxscale.plan import report
from jaxscale.plan.compiled import refused_by_xla
from jaxscale.plan.measure import agreed, seconds_per_step
from jaxscale.plan.planner import Row, make_plan
from jaxscale.plan.targets import local_target
from jaxscale.runtime.chips import GIB


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

    check_schema(config)  # the numbers read below, before the planner's validate reads them
    gib, trials = config.mesh.auto_memory_gib, config.mesh.auto_trials
    # Without mesh.auto_memory_gib, plan for the capacity the run's memory check will hold the
    # step to (performance.device_memory_gib, else the allocator's limit), else the chip's.
    local = [d for d in devices if d.process_index == jax.process_index()]
    capacity = device_capacity(local, config.performance.device_memory_gib)
    check_attention(config, devices[0])  # the planner compiles with that kernel
    capacity_bytes = int(gib * GIB) if gib else capacity[0] if capacity else None
    target = local_target(devices)
    say(f"mesh.auto: planning the layout for {len(devices)} {devices[0].device_kind} device(s)")
    plan = make_plan(config, target, top=trials, capacity=capacity_bytes, devices=devices,
                     spread=trials > 1, log=say)
    say(report.header(plan))
    say(report.table(plan))
    if plan.chosen is None:
        raise ConfigError(f"mesh.auto: {report.no_fit(plan)}")
    # The trials: the compiled rows that fit, `trials` at most (with trials > 1 they are a
    # spread of the near-tied meshes, jaxscale/plan/planner.py spread_order).
    timed = [r for r in plan.rows if r.executable is not None and plan.fits(r)][:trials]
    if len(timed) > 1:
        plan.chosen = fastest_measured(timed, config, devices, say)
    chosen = plan.chosen
    say(report.chosen(plan))
    return chosen.candidate.apply(config), (chosen.executable, chosen.compiled)


def fastest_measured(rows: list[Row], config: ml_collections.ConfigDict, devices, say) -> Row:
    """The row of `rows` (compiled, fitting) whose step runs fastest on `devices`."""
    seconds = []
    for row in rows:
        try:
            seconds.append(seconds_per_step(row.candidate.apply(config), devices,
                                            row.executable))
        except jax.errors.JaxRuntimeError as e:  # out of memory at run time: not a choice
            if not refused_by_xla(e):
                raise
            say(f"timing {row.candidate.summary()} failed: {' '.join(str(e).split())[:200]}")
            seconds.append(float("inf"))
    seconds = agreed(seconds)
    for row, s in zip(rows, seconds):
        say(f"timed {row.candidate.summary()}: {s:.4g} s per step (the model's estimate "
            f"{row.time.total:.3g} s)")
    return rows[seconds.index(min(seconds))]
