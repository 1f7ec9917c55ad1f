"""Mixture of experts: `configs/tiny_moe.py` (8 experts of width 384, top-2) against the dense tiny
model of the same active parameters (`configs/tiny.py`, width 768), on 8 devices.

    python benchmarks/moe.py [--rounds=3] [--steps=3] [--config.KEY=VALUE ...]

Five sides, batch 16 x 128, XLA attention: dense on data=8, tiny_moe on data=8 (expert=1: every
device holds every expert), tiny_moe on expert=8 (one expert per device, tokens exchanged by
all-to-all), and dropless tiny_moe (model.moe.capacity_factor=0: grouped matmuls, nothing
dropped) on the same two meshes (on expert=8 the weights are gathered to the tokens). Each is
compiled for two targets and reports the compiled train step's memory per device
(`memory_analysis()`: arguments + outputs - aliased + temporaries): 8 simulated CPU
devices, where it also runs (tokens/s, in alternating rounds keeping each side's best), and a TPU
v5p:2x2x2 slice (8 chips, compiled with libtpu, no TPU needed).

The last line is `ratio: X` = total per device with expert=8 / with expert=1 on the TPU target.
Its target, printed above it: expert=8 keeps 1/8 of the experts' float32 parameters, gradients and
AdamW moments (16 bytes a parameter), so ratio <= 1 - 7/8 x 16 x expert parameters / expert=1's
total. The dense layers' state is the same on both sides.
"""

from __future__ import annotations

import argparse
import math
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
from jaxscale.plan.compiled import compile_train_step  # noqa: E402
from jaxscale.plan.measure import random_batch  # noqa: E402
from jaxscale.plan.targets import parse_target, target_devices  # noqa: E402
from jaxscale.runtime.chips import GIB  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402

DROPLESS = ["--config.model.moe.capacity_factor=0"]
SIDES = {  # name -> (config file, mesh, overrides)
    "dense (data=8)": ("tiny.py", dict(data=8, expert=1), []),
    "tiny_moe (expert=1)": ("tiny_moe.py", dict(data=8, expert=1), []),
    "tiny_moe (expert=8)": ("tiny_moe.py", dict(data=1, expert=8), []),
    "dropless (expert=1)": ("tiny_moe.py", dict(data=8, expert=1), DROPLESS),
    "dropless (expert=8)": ("tiny_moe.py", dict(data=1, expert=8), DROPLESS),
}
EXPERT_WEIGHTS = ("['gate']", "['up']", "['down']")


def config_for(config_file: str, mesh: dict, side: list[str], overrides: list[str]):
    config, _ = parse_train_flags(
        ["moe", f"--config={REPO}/configs/{config_file}", "--config.train.batch_size=16",
         "--config.model.attention=xla",
         *(f"--config.mesh.{axis}={size}" for axis, size in mesh.items()), *side, *overrides])
    return config


def expert_params(config) -> int:
    """Parameters of the MoE layers' expert weights (not the routers)."""
    return sum(math.prod(leaf.shape) for path, leaf in
               jax.tree_util.tree_leaves_with_path(model_spec(config).abstract_params)
               if jax.tree_util.keystr(path[-1:]) in EXPERT_WEIGHTS and len(leaf.shape) == 4)


def build(config, workdir: str):
    """[compiled step, state, batch, memory] on the CPU devices, after one step (the compile)."""
    trainer = Trainer(config, workdir)
    compiled, memory = trainer.compile_train_step()
    state = trainer.program.init_state(0)
    batch = jax.device_put(random_batch(config), trainer.program.batch_sharding)
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    return [compiled, state, batch, memory]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    parser.add_argument("--steps", type=int, default=3, help="train steps per round")
    args, overrides = parser.parse_known_args()
    configs = {name: config_for(*side, overrides) for name, side in SIDES.items()}

    print("TPU v5p:2x2x2 (compiled only), per chip:")
    tpu_devices = target_devices(parse_target("v5p:2x2x2"))
    tpu = {}
    for name, config in configs.items():
        tpu[name] = compile_train_step(config, tpu_devices)[1]
        print(f"{name:>20}: {tpu[name].line()}")

    with tempfile.TemporaryDirectory() as workdir:
        sides = {name: build(config, workdir) for name, config in configs.items()}
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.rounds):
            for name, side in sides.items():
                side[1], seconds = seconds_per_step(side[0], side[1], side[2], args.steps)
                best[name] = min(best[name], seconds)
    print("CPU, 8 simulated devices, per device:")
    for name, (_, _, _, memory) in sides.items():
        t, spec = configs[name].train, model_spec(configs[name])
        active = spec.config.active_params(spec.num_params)
        print(f"{name:>20}: {spec.num_params / 1e6:6.2f}M parameters ({active / 1e6:.2f}M "
              f"active), {t.batch_size * t.seq_len / best[name]:6.0f} tokens/s; {memory.line()}")
    dense, moe1, moe8, dropless1, dropless8 = (best[name] for name in SIDES)
    print(f"tokens/s tiny_moe / dense: expert=1 {dense / moe1:.3f}, expert=8 {dense / moe8:.3f}")
    print(f"tokens/s dropless / capacity: expert=1 {moe1 / dropless1:.3f}, "
          f"expert=8 {moe8 / dropless8:.3f}")
    one, eight = list(SIDES)[1:3]
    cpu_one, cpu_eight = sides[one][3].total, sides[eight][3].total
    print(f"CPU: expert=8 / expert=1 total per device {cpu_eight / cpu_one:.4f}")
    saved = 7 / 8 * 16 * expert_params(configs[one])
    print(f"target (TPU): ratio <= 1 - {saved / GIB:.3g} GiB / {tpu[one].total / GIB:.3g} GiB = "
          f"{1 - saved / tpu[one].total:.4f}")
    print("ratio below: TPU v5p:2x2x2, tiny_moe, expert=8 / expert=1 total per device")
    print(f"ratio: {tpu[eight].total / tpu[one].total:.4f}")


if __name__ == "__main__":
    main()
