"""Pipeline schedules on 8 simulated CPU devices: activation memory and step time of GPipe and 1F1B
(mesh.pipeline=4 x data=2) for M = 4, 8 and 16 microbatches, against no pipeline (data=8), each at
remat none, full and save_dots.

    python benchmarks/pipeline.py [--steps=2] [--remats=none,full,save_dots] [--config.K=V ...]

For each remat policy, schedule and M: the compiled step's temporary memory per device
(`compiled.memory_analysis()`: activations, stash, gradient accumulators), the theoretical bubble
and the step time. The CPU devices share this machine's cores, so step times compare the work the
schedules do (bubble compute included), not what 8 real chips would take.

Which rows compare like with like: 1F1B always stashes only each stage's input and recomputes the
stage in its backward, whatever `model.remat` says (the policy only decides what one stage's
backward keeps while it runs): it is full remat at the stage by construction. GPipe keeps, for
every microbatch, what the policy keeps. So only the `remat full` rows compare the two schedules
at the same memory policy (both keep inputs and recompute the rest); at `none` and `save_dots`
GPipe keeps activations that 1F1B recomputes. Last line: `ratio: X` = 1F1B / GPipe temporary
memory at M=16, both at remat full. Target <= 0.5 (theory for S=4 stages: 2S - 1 = 7 stashed
stage inputs against GPipe's M + S - 1 = 19 ticks of saved inputs).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from jaxscale.cli import parse_train_flags
from jaxscale.parallel.pipeline import Pipeline
from jaxscale.plan.measure import random_batch
from jaxscale.trainer import Trainer

MIB = 2 ** 20
# 8 layers of d_model 128 on 32 sequences of 256 tokens: activations, not weights, fill memory.
MODEL = ["--config.model.n_layers=8", "--config.model.d_model=128", "--config.model.mlp_dim=512",
         "--config.train.batch_size=32", "--config.train.seq_len=256",
         "--config.precision.compute_dtype=float32"]
PIPELINE = ["--config.mesh.data=2", "--config.mesh.pipeline=4"]
RATIO_REMAT, RATIO_MICRO = "full", 16


def measure(flags: list[str], steps: int) -> tuple[float, float]:
    """(temporary MiB per device of the compiled train step, seconds per step)."""
    config, _ = parse_train_flags(["pipeline", *MODEL, *flags])
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        state = trainer.program.init_state(0)
        batch = jax.device_put(random_batch(config), trainer.program.batch_sharding)
        compiled = trainer.program.train_step.lower(state, batch).compile()
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
    parser.add_argument("--remats", default="none,full,save_dots",
                        help="model.remat policies, comma-separated")
    args, overrides = parser.parse_known_args()
    print("1F1B stashes stage inputs and recomputes each stage whatever the policy; "
          "like for like (both schedules keep inputs only): the remat full rows")
    print(f"{'remat':9} {'schedule':8} {'M':>3} {'bubble':>7} {'temp MiB':>9} {'s/step':>7} "
          f"{'x plain':>8}  like for like")
    temps = {}
    for remat in args.remats.split(","):
        policy = f"--config.model.remat={remat}"
        base_temp, base_time = measure(["--config.mesh.data=8", policy, *overrides], args.steps)
        print(f"{remat:9} {'none':8} {'-':>3} {'-':>7} {base_temp:9.1f} {base_time:7.3f} "
              f"{1:8.2f}  (data=8, no pipeline)", flush=True)
        for micro in (4, 8, 16):
            for schedule in ("gpipe", "1f1b"):
                temp, seconds = measure(
                    [*PIPELINE, policy, f"--config.pipeline.microbatches={micro}",
                     f"--config.pipeline.schedule={schedule}", *overrides], args.steps)
                bubble = Pipeline(4, micro, schedule=schedule).bubble_fraction()
                temps[remat, schedule, micro] = temp
                like = "yes" if remat == "full" else "no: GPipe keeps more than inputs"
                print(f"{remat:9} {schedule:8} {micro:3d} {bubble:7.1%} {temp:9.1f} "
                      f"{seconds:7.3f} {seconds / base_time:8.2f}  {like}", flush=True)
    key = (RATIO_REMAT, "1f1b", RATIO_MICRO)
    if key in temps:
        gpipe = temps[RATIO_REMAT, "gpipe", RATIO_MICRO]
        print(f"ratio: {temps[key] / gpipe:.4f}  (1F1B / GPipe temporaries, M={RATIO_MICRO}, "
              f"remat {RATIO_REMAT} on both)")


if __name__ == "__main__":
    main()
