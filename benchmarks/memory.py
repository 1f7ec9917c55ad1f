"""Memory per chip of a train step, from the TPU compiler (no TPU needed).

    pip install -e '.[tpu]'
    python benchmarks/memory.py                             # llama3_8b on v5p-64: vs MaxText
    python benchmarks/memory.py --target=v5e-16
    python benchmarks/memory.py --config=configs/llama_1b.py --config.model.attention=xla

Settings (overridable with --config.KEY=VALUE after them): mesh fsdp = all chips, 2 sequences of
2048 tokens per chip, `model.remat=full`, bfloat16 compute, float32 parameters and Adam moments.
The last line is `ratio: X` = total GiB per chip / 8.24 GiB, what MaxText 0.2.5's `train_compile`
reports for llama3-8b on a v5p:4x4x4 slice (64 chips) with these settings (measured 2026-11-22);
below 1.0 jaxscale needs less. The ratio compares like with like only for that default; for other
targets and configs read the GiB.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; nothing runs here

from jaxscale.cli import Option, fail, parse_config_flags  # noqa: E402
from jaxscale.errors import ConfigError  # noqa: E402
from jaxscale.plan.compiled import compile_train_step  # noqa: E402
from jaxscale.runtime.chips import GIB  # noqa: E402
from jaxscale.plan.targets import parse_target, target_devices  # noqa: E402

MAXTEXT_GIB = 8.24  # MaxText 0.2.5, llama3-8b, v5p:4x4x4, fsdp=64, batch 2/chip, seq 2048, remat full
OPTIONS = [Option("target", "v5p-64", "what to compile for: v5p-64, v5e-16, v5p:2x2x1, cpu:8",
                  "TARGET"),
           Option("per_chip_batch", 2, "sequences per chip", "N")]


def main(argv: list[str]) -> None:
    if not any(a.startswith("--config=") or a == "--config" for a in argv[1:]):
        argv = [argv[0], "--config=configs/llama3_8b.py", *argv[1:]]
    config, options = parse_config_flags(argv, prog="python benchmarks/memory.py",
                                         about=__doc__, options=OPTIONS)
    overridden = " ".join(argv[1:])
    try:
        target = parse_target(options["target"])
        devices = target_devices(target)
    except ConfigError as e:
        fail(str(e))
    # The comparison's settings, unless the command line set them.
    if "--config.mesh." not in overridden:
        config.mesh.update(data=1, fsdp=len(devices), tensor=1)
    if "--config.train.batch_size" not in overridden:
        config.train.batch_size = options["per_chip_batch"] * len(devices)
    if "--config.train.seq_len" not in overridden:
        config.train.seq_len = 2048
    if "--config.model.remat" not in overridden:
        config.model.remat = "full"

    start = time.perf_counter()
    compiled, memory = compile_train_step(config, devices)
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mesh = {axis: config.mesh[axis] for axis in ("data", "fsdp", "tensor")}
    print(f"{overridden or 'defaults'}: {target.name} ({devices[0].device_kind}), mesh "
          f"{mesh}, batch {config.train.batch_size} x "
          f"{config.train.seq_len}, remat {config.model.remat}; compiled in {seconds:.0f} s")
    print(memory.line())
    print(f"bytes accessed per step (compiler's estimate): "
          f"{cost.get('bytes accessed', 0) / GIB:.1f} GiB")
    print(f"ratio: {memory.total / GIB / MAXTEXT_GIB:.4f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
