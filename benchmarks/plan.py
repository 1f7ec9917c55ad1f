"""The planner, measured on 8 CPU devices against standard layouts, and its estimates for TPUs.

    pip install -e '.[tpu]'
    python benchmarks/plan.py                 # both parts
    python benchmarks/plan.py --models=       # the measured part only
    python benchmarks/plan.py --models=llama_1b --targets=v5p-64 --rounds=5

1. Measured, on 8 simulated CPU devices: `configs/tiny.py` laid out by the planner (what
   `mesh.auto=True` does at start-up: it compiles `mesh.auto_trials` candidates, a spread of
   distinct meshes among those its estimate cannot tell apart (docs/planning.md), times them and
   keeps the fastest) and by three standard layouts, data=8, fsdp=8 and
   fsdp=4 x tensor=2, which keep every other setting of the config (batch, sequence, remat,
   dtype, accumulation, optimizer-state layout). Each is timed here, on random tokens, in seconds
   per step: the layouts take turns for --rounds rounds, each round a warm-up step and the
   median of 3 (`jaxscale.plan.measure.seconds_per_step`), and a layout's figure is the median of
   its rounds. The 8 devices share this machine's cores, so the times compare the layouts' work
   and collectives on a CPU, not on accelerators.
2. Estimated, for TPU slices (no TPU needed): each plan compiles the fastest candidates the
   memory estimate fits (--top of them) with the TPU compiler on this host; the figures are the
   compiler's GiB per chip and the model's estimated step time and MFU (compute at peak, memory
   traffic and communication from the compiled HLO; docs/planning.md). Nothing runs; those times
   are the planner's own estimates, not measurements.

The last line is `ratio: X` = the chosen layout's measured s/step / the fastest standard
layout's, both measured in this run (target <= 1.05): above 1 a layout picked by hand was faster.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # TPU targets are compiled for; nothing runs there

import jax

from jaxscale.cli import Option, fail, load_config_file
from jaxscale.config import MESH_AXES
from jaxscale.errors import ConfigError
from jaxscale.plan.auto import planned_config
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.measure import seconds_per_step
from jaxscale.plan.planner import make_plan
from jaxscale.plan.targets import parse_target
from jaxscale.runtime.chips import GIB

OPTIONS = [Option("models", "llama_1b,llama3_8b",
                  "configs/<name>.py to plan for TPU slices (estimates), comma-separated; empty: "
                  "none", "NAMES"),
           Option("targets", "v5e-16,v5p-64,v5p-256", "TPU slices, comma-separated", "TARGETS"),
           Option("top", 1, "candidates compiled per TPU plan (more when none fits)", "K"),
           Option("rounds", 3, "timing rounds of every measured layout, taking turns", "N")]
MEASURED = "tiny"
STANDARD = {"data=8": dict(data=8), "fsdp=8": dict(fsdp=8),
            "fsdp=4 x tensor=2": dict(fsdp=4, tensor=2)}


def with_mesh(config, **sizes):
    """A copy of `config` on the mesh `sizes` (every other axis 1), otherwise unchanged."""
    config = config.copy_and_resolve_references()
    config.mesh.update({a: sizes.get(a, 1) for a in MESH_AXES})
    return config


def layout(config) -> tuple:
    """What a planner's choice may change in a config."""
    return (tuple(config.mesh[a] for a in MESH_AXES), config.model.remat,
            config.train.microbatches, config.sharding.optimizer_state,
            config.pipeline.schedule, config.pipeline.microbatches)


def measured(rounds: int) -> float:
    """Times the planner's layout for configs/tiny.py and the standard ones on the 8 CPU devices;
    prints their table and returns the chosen layout's s/step over the fastest standard's."""
    config = load_config_file(f"configs/{MEASURED}.py")
    devices = jax.devices()
    t, m = config.train, config.model
    print(f"measured: configs/{MEASURED}.py on {len(devices)} CPU devices (batch "
          f"{t.batch_size} x {t.seq_len}, remat {m.remat}, {config.precision.compute_dtype}); "
          f"the planner's choice (mesh.auto):", flush=True)
    chosen, (executable, _) = planned_config(config, devices)
    layouts = {"chosen": (chosen, executable)}
    for name, sizes in STANDARD.items():
        standard = with_mesh(config, **sizes)
        layouts[name] = (standard, compile_train_step(standard, devices)[0])
    times = {name: [] for name in layouts}
    for _ in range(rounds):
        for name, (layout_config, step) in layouts.items():
            times[name].append(seconds_per_step(layout_config, devices, step))
    seconds = {name: statistics.median(s) for name, s in times.items()}
    best = min((name for name in STANDARD), key=seconds.get)
    same = [name for name in STANDARD if layout(layouts[name][0]) == layout(chosen)]
    print(f"measured s/step, median of {rounds} rounds (each the median of 3 steps after a "
          f"warm-up), the layouts taking turns:")
    print(f"  {'layout':20} {'s/step':>8} {'x best standard':>16}  rounds")
    for name, s in seconds.items():
        label = name if name != "chosen" else "chosen" + (f" (= {same[0]})" if same else "")
        print(f"  {label:20} {s:8.3f} {s / seconds[best]:16.3f}  "
              + " ".join(f"{x:.3f}" for x in times[name]), flush=True)
    return seconds["chosen"] / seconds[best]


def _describe(row, plan) -> str:
    c = row.candidate
    memory = (f"{row.compiled.total / GIB:.1f} GiB/chip compiled" if row.compiled
              else f"{row.estimate.total / GIB:.1f} GiB/chip estimated")
    mfu = row.time.mfu(plan.target.num_devices, plan.chip.peak_bf16_flops)
    return f"{c.summary()}: {memory}, model's estimate {row.time.total:.2f} s/step, MFU {mfu:.0%}"


def estimated(models: list[str], targets: list[str], top: int) -> None:
    """Plans each model for each TPU slice and prints the choice with the model's estimates."""
    for name in models:
        for spec in targets:
            try:
                config = load_config_file(f"configs/{name}.py")
                target = parse_target(spec)
            except ConfigError as e:
                fail(str(e))
            start = time.perf_counter()
            plan = make_plan(config, target, top=top)
            seconds = time.perf_counter() - start
            compiled = sum(r.compiled is not None or r.error is not None for r in plan.rows)
            t = config.train
            print(f"estimated: {name} on {spec} (batch {t.batch_size} x {t.seq_len}): "
                  f"{plan.searched} candidates, {compiled} compiled, planned in {seconds:.0f} s",
                  flush=True)
            if plan.chosen is None:
                small = plan.smallest
                print(f"  chosen: none fits {plan.budget / GIB:.1f} GiB; the smallest needs "
                      f"{small.bytes / GIB:.1f} GiB (estimate)", flush=True)
            else:
                print(f"  chosen: {_describe(plan.chosen, plan)}", flush=True)
            for row in plan.rows:
                if row.role:
                    print(f"  {row.role}: {_describe(row, plan)} -> {plan.verdict(row)}",
                          flush=True)


def main(argv: list[str]) -> None:
    import absl.flags  # the same flag parser as the CLI's options

    flags = absl.flags.FlagValues()
    for o in OPTIONS:
        define = absl.flags.DEFINE_integer if isinstance(o.default, int) else \
            absl.flags.DEFINE_string
        define(o.name, o.default, o.help, flag_values=flags)
    try:
        flags(argv)
    except absl.flags.Error as e:
        fail(str(e))
    ratio = measured(flags.rounds)
    estimated([m for m in flags.models.split(",") if m], flags.targets.split(","), flags.top)
    print(f"ratio: {ratio:.4f}  (chosen layout / fastest standard layout, s/step measured on 8 "
          f"CPU devices)")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
