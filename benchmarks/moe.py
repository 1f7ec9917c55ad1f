"""Mixture of experts: `configs/tiny_moe.py` (8 experts of width 384, top-2) against the dense tiny
model of the same active parameters (`configs/tiny.py`, width 768), on 8 simulated CPU devices.

    python benchmarks/moe.py [--rounds=3] [--steps=3] [--config.KEY=VALUE ...]

Trains three sides in alternating rounds, keeping each one's best step time: dense on data=8,
tiny_moe on data=8 (expert=1: every device holds every expert) and tiny_moe on expert=8 (one
expert per device, tokens exchanged by all-to-all). Prints their tokens/s and the per-device
bytes of the experts' parameters (from the arrays' shardings), and last `ratio: X` = per-device
expert bytes with expert=8 / with expert=1. Target <= 1/8 + 5% (0.131).
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from jaxscale.cli import parse_train_flags  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402
from tests.helpers import random_batch  # noqa: E402

SIDES = {  # name -> (config file, mesh)
    "dense (data=8)": ("tiny.py", dict(data=8, expert=1)),
    "tiny_moe (expert=1)": ("tiny_moe.py", dict(data=8, expert=1)),
    "tiny_moe (expert=8)": ("tiny_moe.py", dict(data=1, expert=8)),
}
EXPERT_WEIGHTS = ("['gate']", "['up']", "['down']")


def build(config_file: str, mesh: dict, overrides: list[str], workdir: str):
    config, _ = parse_train_flags(
        ["moe", f"--config={REPO}/configs/{config_file}", "--config.train.batch_size=16",
         *(f"--config.mesh.{axis}={size}" for axis, size in mesh.items()), *overrides])
    trainer = Trainer(config, workdir)
    state = trainer.init_state(0)
    batch = jax.device_put(random_batch(config), trainer.batch_sharding)
    state, metrics = trainer.train_step(state, batch)  # compile
    jax.block_until_ready(metrics)
    return trainer, state, batch


def expert_bytes_per_device(state) -> int:
    """Bytes of the MoE layers' expert weights (not the routers) on the first device."""
    return sum(leaf.addressable_shards[0].data.nbytes
               for path, leaf in jax.tree_util.tree_leaves_with_path(state.params)
               if jax.tree_util.keystr(path[-1:]) in EXPERT_WEIGHTS and leaf.ndim == 4)


def timed(trainer, state, batch, steps: int):
    begin = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - begin) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per side")
    parser.add_argument("--steps", type=int, default=3, help="train steps per round")
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as workdir:
        sides = {name: list(build(*side, overrides, workdir)) for name, side in SIDES.items()}
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.rounds):
            for name, (trainer, state, batch) in sides.items():
                state, seconds = timed(trainer, state, batch, args.steps)
                sides[name][1] = state
                best[name] = min(best[name], seconds)
    for name, (trainer, state, _) in sides.items():
        t, model = trainer.config.train, trainer.model
        active = model.config.active_params(model.num_params)
        print(f"{name:>20}: {model.num_params / 1e6:6.2f}M parameters ({active / 1e6:.2f}M "
              f"active), {t.batch_size * t.seq_len / best[name]:9.0f} tokens/s, expert weights "
              f"{expert_bytes_per_device(state) / 2**20:6.2f} MiB per device")
    dense, moe1, moe8 = (best[name] for name in SIDES)
    print(f"tokens/s tiny_moe / dense: expert=1 {dense / moe1:.3f}, expert=8 {dense / moe8:.3f}")
    one, eight = (expert_bytes_per_device(sides[name][1]) for name in list(SIDES)[1:])
    print(f"ratio: {eight / one:.4f}")


if __name__ == "__main__":
    main()
