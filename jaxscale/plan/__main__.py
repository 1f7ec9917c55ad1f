"""`python -m jaxscale.plan --config=configs/NAME.py --target=T [--top=K] [--json]
[--config.KEY=VALUE ...]`

Chooses how to lay a config's training step out over a target's devices: every data/fsdp/tensor
layout the model allows, times remat policy, gradient accumulation and optimizer-state layout;
the most promising are compiled for the target (TPU slices too, on any host, with libtpu) and
judged by the compiler's memory per device and the collectives in their program. Prints a table,
the choice, and the --config flags that run it (--json: the same as JSON); when nothing fits,
one `error:` line says by how much (exit status 2). docs/planning.md explains the estimates and
how to read the table.

Targets: local, cpu:N, v4-N / v5e-N / v5p-N / v6e-N (chips) or v5p:4x4x4 (topology),
h100:N / h200:N / a100:N or h100:NODESxGPUS, compiled on any host where XLA's GPU compiler is
installed (pip install 'jaxscale[gpu-compile]'; no GPU needed), else planned from the estimates
alone.
"""

from __future__ import annotations

import json
import os
import re
import sys

from jaxscale.cli import Option, fail, fail_with, parse_config_flags
from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.kinds import real, whole
from jaxscale.runtime.chips import GIB

OPTIONS = [
    Option("target", "local", "what to plan for: local, cpu:8, v5p-64, v5e-16, v5p:2x2x1, h100:16, "
           "h100:2x8", "TARGET"),
    Option("top", 3, "how many candidates to compile (more when none of them fits)", "K",
           kind=whole("[1, inf)")),
    Option("hbm_gib", "", "memory per device to plan for, in GiB (default: the chip's; CPUs "
           "have none unless given)", "GIB"),
    Option("json", False, "print the plan as JSON (the same facts as the table) instead"),
]
HBM_GIB = real("(0, inf)")  # --hbm_gib, once read as a number ("" leaves it to the chip)


def _hbm_gib(text: str) -> float | None:
    """--hbm_gib as GiB, None when not given; exits with `error:` when it is no size."""
    if not text:
        return None
    try:
        gib = float(text)
    except ValueError:
        fail(f"--hbm_gib={text!r} is not a number of GiB, e.g. --hbm_gib=16")
    problem = HBM_GIB.problem(gib)
    if problem:
        fail(f"--hbm_gib={text} {problem}")
    return gib


def _prepare_jax(argv: list[str]) -> None:
    """Before JAX starts: a non-local target is compiled for, never run on, so JAX stays on the
    CPU (libtpu would otherwise try to claim a TPU); `cpu:N` needs N simulated devices."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--target=")), "local")
    if spec != "local":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # XLA's C++ warnings (the SPMD partitioner's "Involuntary full rematerialization" for a
    # candidate it lays out poorly) are about candidates, not mistakes of the user's, and would
    # land among the table's lines; its errors still show. TF_CPP_MIN_LOG_LEVEL=0 shows them all.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if m := re.fullmatch(r"cpu:(\d+)", spec):
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_force_host_platform_device_count={m.group(1)}").strip()


def main(argv: list[str]) -> None:
    config, options = parse_config_flags(argv, prog="python -m jaxscale.plan", about=__doc__,
                                         options=OPTIONS)
    gib = _hbm_gib(options["hbm_gib"])
    _prepare_jax(argv)
    # After the flags, and after _prepare_jax: they import JAX (--help and flag errors stay fast).
    from jaxscale.plan import report
    from jaxscale.plan.planner import make_plan
    from jaxscale.plan.targets import parse_target

    try:
        target = parse_target(options["target"])
        plan = make_plan(config, target, top=options["top"],
                         capacity=None if gib is None else int(gib * GIB),
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    except (JaxscaleError, TransientError) as e:
        fail_with(e)
    if options["json"]:
        print(json.dumps(report.as_json(plan), indent=2))
    else:
        print(report.header(plan))
        print(report.table(plan))
    if plan.chosen is None:
        fail(report.no_fit(plan))
    if not options["json"]:
        print(report.chosen(plan))


if __name__ == "__main__":
    main(sys.argv)
