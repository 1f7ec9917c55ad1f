"""ZeRO-1 (`sharding.optimizer_state=data`) against the optimizer state kept with its parameters
(`params`, here replicated: pure data parallelism), on 8 simulated CPU devices (data=8).

    python benchmarks/zero.py [--rounds=5] [--steps=5] [--config.KEY=VALUE ...]

Prints per-device optimizer-state bytes (from the arrays' shardings) and step time of both, in
alternating rounds keeping each side's best, and last `ratio: X` = ZeRO-1 / replicated
optimizer-state bytes per device. Target <= 0.132 (1/8 plus the replicated step counters).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxscale.cli import parse_train_flags  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402
from tests.helpers import random_batch  # noqa: E402


def build(layout: str, overrides: list[str], workdir: str):
    config, _ = parse_train_flags(["zero", "--config.mesh.data=8", "--config.train.batch_size=16",
                             f"--config.sharding.optimizer_state={layout}", *overrides])
    trainer = Trainer(config, workdir)
    state = trainer.init_state(0)
    batch = jax.device_put(random_batch(config), trainer.batch_sharding)
    state, metrics = trainer.train_step(state, batch)  # compile
    jax.block_until_ready(metrics)
    return trainer, state, batch


def optimizer_bytes_per_device(state) -> int:
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.opt_state))


def timed(trainer, state, batch, steps: int):
    begin = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - begin) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per side")
    parser.add_argument("--steps", type=int, default=5, help="train steps per round")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as workdir:
        sides = {layout: list(build(layout, overrides, workdir)) for layout in ("params", "data")}
        best = {layout: float("inf") for layout in sides}
        for _ in range(args.rounds):
            for layout, (trainer, state, batch) in sides.items():
                state, seconds = timed(trainer, state, batch, args.steps)
                sides[layout][1] = state
                best[layout] = min(best[layout], seconds)
        size = {layout: optimizer_bytes_per_device(sides[layout][1]) for layout in sides}
    print(f"model: {sides['params'][0].model.num_params:,} parameters, mesh data=8 (CPU)")
    for layout, name in (("params", "replicated (params)"), ("data", "ZeRO-1 (data)")):
        print(f"{name:>20}: optimizer state {size[layout] / 2**20:8.2f} MiB per device, "
              f"step {best[layout] * 1e3:8.1f} ms")
    print(f"step time ZeRO-1 / replicated: {best['data'] / best['params']:.3f}")
    print(f"ratio: {size['data'] / size['params']:.4f}")


if __name__ == "__main__":
    main()
