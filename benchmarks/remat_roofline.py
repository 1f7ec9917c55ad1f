"""The planner's step-time terms for each remat policy, beside the measured step times: the
figures that say whether its roofline (compute at peak, memory traffic at the HBM bandwidth)
orders the policies as the chip does.

    python benchmarks/remat_roofline.py                         # the local devices, timed
    python benchmarks/remat_roofline.py --target=v5p:2x2x1      # a TPU topology: compiled only
    python benchmarks/remat_roofline.py --target=v5p:2x2x1 --chip="H100 SXM"  # at its rates

For each policy (none, save_dots, full) the train step of --config (per device: --batch rows of
the config's sequence, parameters sharded over all devices with FSDP) is compiled, and one line
prints: the compiler's FLOPs and bytes accessed (`cost_analysis()`, a scanned layer once), the
bytes counted with every loop once per trip (`jaxscale.plan.traffic`, what the planner uses), the
planner's compute and memory seconds and its estimated step, at the rates of --chip (default:
the devices'); on local accelerators, the median seconds per step measured here
(`jaxscale.plan.measure.seconds_per_step`). The last lines give the estimated and the measured
order, fastest first. With --hlo_dir=DIR each policy's compiled program goes to
DIR/remat_POLICY.hlo.txt, for reading what the count adds up (`jaxscale/plan/traffic.py`).
"""

from __future__ import annotations

import os
import sys

import jax

from jaxscale.cli import fail, load_config_file
from jaxscale.errors import ConfigError
from jaxscale.models.decoder import REMAT_POLICIES
from jaxscale.models.spec import model_spec
from jaxscale.plan import rank
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.measure import seconds_per_step
from jaxscale.plan.planner import NOMINAL_CPU
from jaxscale.plan.search import Candidate, layout
from jaxscale.plan.targets import local_target, parse_target, target_devices
from jaxscale.plan.traffic import bytes_accessed
from jaxscale.runtime.chips import CHIPS, GIB


def main(argv: list[str]) -> None:
    import absl.flags  # the same flag parser as the CLI's options

    flags = absl.flags.FlagValues()
    absl.flags.DEFINE_string("config", "configs/llama_1b.py", "the config file", flag_values=flags)
    absl.flags.DEFINE_string("target", "", "a TPU topology to compile for (nothing runs); empty: "
                             "the local devices, timed", flag_values=flags)
    absl.flags.DEFINE_integer("batch", 4, "rows per device", flag_values=flags)
    absl.flags.DEFINE_enum("chip", None, list(CHIPS), "the chip whose rates the estimates use "
                           "(default: the devices')", flag_values=flags)
    absl.flags.DEFINE_string("hlo_dir", "", "a folder to write each policy's compiled program "
                             "into (empty: none)", flag_values=flags)
    try:
        flags(argv)
        target = parse_target(flags.target) if flags.target else local_target(jax.devices())
        devices = target_devices(target) if flags.target else jax.devices()
    except (absl.flags.Error, ConfigError) as e:
        fail(str(e))
    chip = CHIPS[flags.chip] if flags.chip else target.chip or NOMINAL_CPU
    n = len(devices)
    timed = not flags.target and target.chip is not None
    print(f"{n} x {devices[0].device_kind}, estimates at {chip.name}'s rates, jax "
          f"{jax.__version__}; {flags.config}, {flags.batch} x "
          f"{load_config_file(flags.config).train.seq_len} tokens per device")
    estimated, measured = {}, {}
    for remat in REMAT_POLICIES:
        config = load_config_file(flags.config)
        config.model.remat = remat
        config.train.batch_size = flags.batch * n
        config.mesh.update(data=1, fsdp=n)
        compiled, memory = compile_train_step(config, devices)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        hlo = compiled.as_text()
        counted = bytes_accessed(hlo)
        if flags.hlo_dir:
            os.makedirs(flags.hlo_dir, exist_ok=True)
            with open(os.path.join(flags.hlo_dir, f"remat_{remat}.hlo.txt"), "w") as f:
                f.write(hlo)
        candidate = Candidate(*layout({"fsdp": n}), remat, 1, "params")
        t = rank.step_time(config, model_spec(config), candidate, [], chip, n, counted)
        estimated[remat] = t.total
        line = (f"remat {remat}: {memory.total / GIB:.2f} GiB, XLA flops {cost['flops']:.4g} "
                f"bytes {cost['bytes accessed'] / GIB:.1f} GiB; counted {counted / GIB:.1f} "
                f"GiB; compute {t.compute:.4f} s, memory {t.memory:.4f} s, estimate "
                f"{t.total:.4f} s")
        if timed:
            measured[remat] = seconds_per_step(config, devices, compiled)
            line += f", measured {measured[remat]:.4f} s"
        print(line, flush=True)
    print("estimated order:", " < ".join(sorted(estimated, key=estimated.get)))
    if measured:
        print("measured order: ", " < ".join(sorted(measured, key=measured.get)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
