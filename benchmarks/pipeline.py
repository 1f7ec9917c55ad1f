"""Pipeline schedules on 8 simulated CPU devices: activation memory and step time of GPipe and 1F1B
(mesh.pipeline=4 x data=2) for M = 4, 8 and 16 microbatches, against no pipeline (data=8).

    python benchmarks/pipeline.py [--steps=2] [--config.KEY=VALUE ...]

For each schedule and M: the compiled step's temporary memory per device
(`compiled.memory_analysis()`: activations, stash, gradient accumulators), the theoretical bubble
and the step time. The CPU devices share this machine's cores, so step times compare the work the
schedules do (bubble compute included), not what 8 real chips would take. Last line: `ratio: X` =
1F1B / GPipe temporary memory at M=16. Target <= 0.5.
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
from jaxscale.parallel.pipeline import Pipeline  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402
from tests.helpers import random_batch  # noqa: E402

MIB = 2 ** 20
# 8 layers of d_model 128 on 32 sequences of 256 tokens, nothing rematerialised (the default):
# activations, not weights, fill memory.
MODEL = ["--config.model.n_layers=8", "--config.model.d_model=128", "--config.model.mlp_dim=512",
         "--config.model.remat=none", "--config.train.batch_size=32", "--config.train.seq_len=256",
         "--config.precision.compute_dtype=float32"]


def measure(flags: list[str], steps: int) -> tuple[float, float]:
    """(temporary MiB per device of the compiled train step, seconds per step)."""
    config, _ = parse_train_flags(["pipeline", *MODEL, *flags])
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        state = trainer.init_state(0)
        batch = jax.device_put(random_batch(config), trainer.batch_sharding)
        compiled = trainer.train_step.lower(state, batch).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes / MIB
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        begin = time.perf_counter()
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        return temp, (time.perf_counter() - begin) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed train steps per layout")
    args, overrides = parser.parse_known_args()
    base_temp, base_time = measure(["--config.mesh.data=8", *overrides], args.steps)
    print(f"no pipeline (data=8): temporaries {base_temp:.1f} MiB/device, "
          f"{base_time:.3f} s/step")
    print(f"{'schedule':8} {'M':>3} {'bubble':>7} {'temp MiB':>9} {'s/step':>7} {'x plain':>8}")
    temps = {}
    for micro in (4, 8, 16):
        for schedule in ("gpipe", "1f1b"):
            temp, seconds = measure(
                ["--config.mesh.data=2", "--config.mesh.pipeline=4",
                 f"--config.pipeline.microbatches={micro}",
                 f"--config.pipeline.schedule={schedule}", *overrides], args.steps)
            bubble = Pipeline(4, micro, schedule=schedule).bubble_fraction()
            temps[schedule, micro] = temp
            print(f"{schedule:8} {micro:3d} {bubble:7.1%} {temp:9.1f} {seconds:7.3f} "
                  f"{seconds / base_time:8.2f}", flush=True)
    print(f"ratio: {temps['1f1b', 16] / temps['gpipe', 16]:.4f}")


if __name__ == "__main__":
    main()
