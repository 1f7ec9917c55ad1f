"""The planner on real slice sizes: planning time, candidates compiled, and the chosen plans.

    pip install -e '.[tpu]'
    python benchmarks/plan.py           # llama_1b and llama3_8b on v5e-16, v5p-64 and v5p-256
    python benchmarks/plan.py --models=llama_1b --targets=v5p-64

Each plan compiles the fastest candidates the memory estimate fits (--top of them) with the TPU
compiler on this host; the figures are the compiler's GiB per chip and the planner's estimated
step time and MFU (compute at peak, communication from the compiled HLO; docs/planning.md).
The last line is `ratio: X` = estimated step time of llama3_8b's chosen plan on v5p-64 / that of
FSDP over all 64 chips with the config's own settings (remat full, no accumulation), compiled
too; below 1.0 the planner found a faster layout.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; nothing runs here

from jaxscale.cli import Option, fail, load_config_file  # noqa: E402
from jaxscale.errors import ConfigError  # noqa: E402
from jaxscale.plan.compiled import GIB  # noqa: E402
from jaxscale.plan.planner import make_plan  # noqa: E402
from jaxscale.plan.targets import parse_target  # noqa: E402

OPTIONS = [Option("models", "llama_1b,llama3_8b", "configs/<name>.py, comma-separated", "NAMES"),
           Option("targets", "v5e-16,v5p-64,v5p-256", "TPU slices, comma-separated", "TARGETS"),
           Option("top", 1, "candidates compiled per plan (more when none fits)", "K")]
RATIO_PLAN = ("llama3_8b", "v5p-64")


def _describe(row, plan) -> str:
    c = row.candidate
    memory = (f"{row.compiled.total / GIB:.1f} GiB/chip compiled" if row.compiled
              else f"{row.estimate.total / GIB:.1f} GiB/chip estimated")
    mfu = row.time.mfu(plan.target.num_devices, plan.chip.peak_bf16_flops)
    return f"{c.summary()}: {memory}, est. {row.time.total:.2f} s/step, MFU {mfu:.0%}"


def main(argv: list[str]) -> None:
    import absl.flags  # noqa: PLC0415 - the same flag parser as the CLI's options

    flags = absl.flags.FlagValues()
    for o in OPTIONS:
        define = absl.flags.DEFINE_integer if isinstance(o.default, int) else \
            absl.flags.DEFINE_string
        define(o.name, o.default, o.help, flag_values=flags)
    try:
        flags(argv)
    except absl.flags.Error as e:
        fail(str(e))
    ratio = None
    for name in flags.models.split(","):
        for spec in flags.targets.split(","):
            try:
                config = load_config_file(f"configs/{name}.py")
                target = parse_target(spec)
            except ConfigError as e:
                fail(str(e))
            start = time.perf_counter()
            plan = make_plan(config, target, top=flags.top,
                             compile_references=(name, spec) == RATIO_PLAN)
            seconds = time.perf_counter() - start
            compiled = sum(r.compiled is not None or r.error is not None for r in plan.rows)
            t = config.train
            print(f"{name} on {spec} (batch {t.batch_size} x {t.seq_len}): {plan.searched} "
                  f"candidates, {compiled} compiled, planned in {seconds:.0f} s", flush=True)
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
            if (name, spec) == RATIO_PLAN and plan.chosen is not None:
                fsdp = next(r for r in plan.rows if r.role == "FSDP only")
                ratio = plan.chosen.time.total / fsdp.time.total
    if ratio is not None:
        print(f"ratio: {ratio:.4f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
