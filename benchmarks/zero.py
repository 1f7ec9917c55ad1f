"""ZeRO-1 (`sharding.optimizer_state=data`) against the optimizer state kept with its parameters
(`params`, here replicated: pure data parallelism), in memory per device from the compiled train
step (`memory_analysis()`: arguments + outputs - aliased + temporaries), on two targets:

- TPU (compile only, with libtpu; no TPU needed): `configs/llama_1b.py` on `v5p:2x2x1`, data=4,
  2 x 2048 tokens per chip, `model.remat=full`, bfloat16 compute;
- CPU: `configs/tiny.py` on 8 simulated devices, data=8, batch 16 x 128, which also runs (step time
  of both, in alternating rounds keeping each side's best).

    python benchmarks/zero.py [--rounds=5] [--steps=5] [--config.KEY=VALUE ...]

Overrides apply to both targets' configs. Each side prints its total per device and the gradient
collectives of its program (HLO: executions per step and bytes per device). The last line is
`ratio: X` = ZeRO-1 / replicated total per device on the TPU target. Its target, printed above it:
ZeRO-1 keeps 1/4 of AdamW's two float32 moments (8 bytes a parameter), so it saves at least 3/4 x 8
bytes a parameter: ratio <= 1 - 6 x parameters / replicated total (0.70 for llama_1b);
reduce-scattered gradients, kept 1/4 per chip, save more.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from timing import seconds_per_step  # noqa: E402

from jaxscale.cli import parse_train_flags  # noqa: E402
from jaxscale.models.spec import model_spec  # noqa: E402
from jaxscale.plan.collectives import parse_collectives  # noqa: E402
from jaxscale.plan.compiled import compile_train_step  # noqa: E402
from jaxscale.plan.measure import random_batch  # noqa: E402
from jaxscale.plan.targets import parse_target, target_devices  # noqa: E402
from jaxscale.runtime.chips import GIB  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402

LAYOUTS = {"params": "replicated (params)", "data": "ZeRO-1 (data)"}
TPU = ["--config=configs/llama_1b.py", "--config.mesh.data=4", "--config.mesh.fsdp=1",
       "--config.train.batch_size=8", "--config.train.seq_len=2048", "--config.model.remat=full"]
CPU = ["--config=configs/tiny.py", "--config.mesh.data=8", "--config.train.batch_size=16"]


def config_for(target_flags: list[str], layout: str, overrides: list[str]):
    config, _ = parse_train_flags(["zero", *target_flags,
                                   f"--config.sharding.optimizer_state={layout}", *overrides])
    return config


def gradient_collectives(compiled, config) -> str:
    """The program's reductions: reduce-scatters and all-reduces, executions per step and bytes
    per device (what each moves, summed over executions)."""
    found = parse_collectives(compiled.as_text(), {a: config.mesh[a] for a in ("data", "fsdp")})
    parts = []
    for kind in ("reduce-scatter", "all-reduce"):
        runs = [c for c in found if c.kind == kind]
        parts.append(f"{sum(c.count for c in runs)} {kind}s "
                     f"({sum(c.bytes * c.count for c in runs) / GIB:.3g} GiB)")
    return ", ".join(parts)


def tpu_side(layout: str, overrides: list[str]) -> tuple[int, str]:
    """(total bytes per device, description)."""
    config = config_for(TPU, layout, overrides)
    compiled, memory = compile_train_step(config, target_devices(parse_target("v5p:2x2x1")))
    return memory.total, f"{memory.line()}; {gradient_collectives(compiled, config)}"


def cpu_side(layout: str, overrides: list[str], workdir: str):
    """[compiled step, state, batch, total bytes per device, description], after a first step
    outside the clock; the rounds replace the state."""
    config = config_for(CPU, layout, overrides)
    trainer = Trainer(config, workdir)
    compiled, memory = trainer.compile_train_step()
    state = trainer.program.init_state(0)
    batch = jax.device_put(random_batch(config), trainer.program.batch_sharding)
    state, metrics = compiled(state, batch)  # the first run, outside the clock
    jax.block_until_ready(metrics)
    return [compiled, state, batch, memory.total,
            f"{memory.line()}; {gradient_collectives(compiled, config)}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per side (CPU)")
    parser.add_argument("--steps", type=int, default=5, help="train steps per round (CPU)")
    args, overrides = parser.parse_known_args()

    print("TPU v5p:2x2x1 (compiled only): llama_1b, data=4, 2 x 2048 tokens per chip, remat full")
    tpu = {}
    for layout, name in LAYOUTS.items():
        tpu[layout], line = tpu_side(layout, overrides)
        print(f"{name:>20}: {line}")

    print("CPU, 8 simulated devices: tiny, data=8, batch 16 x 128")
    with tempfile.TemporaryDirectory() as workdir:
        sides = {layout: cpu_side(layout, overrides, workdir) for layout in LAYOUTS}
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.rounds):
            for layout, side in sides.items():
                side[1], seconds = seconds_per_step(side[0], side[1], side[2], args.steps)
                best[layout] = min(best[layout], seconds)
    for layout, name in LAYOUTS.items():
        print(f"{name:>20}: {sides[layout][4]}; step {best[layout] * 1e3:.1f} ms")
    print(f"CPU: ZeRO-1 / replicated total per device {sides['data'][3] / sides['params'][3]:.4f}, "
          f"step time {best['data'] / best['params']:.3f}")
    replicated = config_for(TPU, "params", overrides)
    data = replicated.mesh.data
    saved = (data - 1) / data * 8 * model_spec(replicated).num_params
    print(f"target (TPU): ratio <= 1 - {saved / GIB:.3g} GiB / {tpu['params'] / GIB:.3g} GiB = "
          f"{1 - saved / tpu['params']:.4f}")
    print("ratio below: TPU v5p:2x2x1, llama_1b, ZeRO-1 / replicated total per device")
    print(f"ratio: {tpu['data'] / tpu['params']:.4f}")


if __name__ == "__main__":
    main()
