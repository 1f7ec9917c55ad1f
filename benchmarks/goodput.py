"""Goodput with a local tier of checkpoints: what a preemption costs with local + persistent
checkpoints against persistent checkpoints alone, at the same persistent interval.

    python benchmarks/goodput.py [--workdir=DIR] [--preemptions=4] [--seed=0]
        [--steps=160] [--every_steps=40] [--local_every_steps=4] [--blocking_repeats=3]

1. Goodput. configs/tiny.py trains `--steps` steps with a persistent checkpoint every
   `--every_steps`, once with a local one every `--local_every_steps` as well ("local+remote") and
   once without ("remote-only"). Each side is killed (SIGKILL: no time to save, as when a host
   fails or a spot VM goes without notice) at the same steps, drawn from `--seed`, and restarted
   with the same command, which resumes from its newest checkpoint (the local folders survive, as
   they do on a host that restarts its process). Both sides load their compiled programs from one
   warm compilation cache. Per preemption: the steps lost (killed at minus restored from) and the
   wall time lost (the restart to its logging the step the run was killed at: start-up, restore
   and the steps redone); per side: the wall time of the whole run, its starts added up (the
   same steps trained: what the local tier costs in saves and gives back in lost work), and its
   median step time. The sides take turns, a start each, so that both see the same load on a
   shared machine.
2. Blocking time of a save, for the llama_1b-sized train state of benchmarks/checkpoint.py (445M
   parameters, 5.3 GB): a local save into `--local_root` (default /dev/shm, a RAM disk) against a
   persistent save into `--remote_root` (default the workdir, on this machine's disk: the only
   slower path here; a bucket would be slower still), taking turns, each save into a fresh
   folder by a fresh manager (its setup counted on both sides; no second copy of 5.3 GB in the
   RAM disk): the part that blocks the loop and the total until durable, medians.

The last line is `ratio: X`, the mean wall time lost per preemption of local+remote / remote-only
(below 1: the local tier gives goodput back).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
from checkpoint import LARGE_MODEL, make_config, state_megabytes  # noqa: E402

from jaxscale.checkpoint import LOCAL, PERSISTENT, Checkpoints  # noqa: E402
from jaxscale.data import make_input  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402

TRAIN = dict(log_every=1, eval_every=0)


def train_flags(workdir: str, steps: int, cache: str, checkpoint: dict) -> list[str]:
    flags = ["--config=configs/tiny.py", f"--workdir={workdir}",
             f"--config.checkpoint.compilation_cache_dir={cache}"]
    flags += [f"--config.train.{k}={v}" for k, v in dict(TRAIN, steps=steps).items()]
    return flags + [f"--config.checkpoint.{k}={v}" for k, v in checkpoint.items()]


class Run:
    """One `python -m jaxscale.train` process of a side, its output in files."""

    def __init__(self, flags: list[str], log: str):
        self.log = log
        with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
            self.process = subprocess.Popen([sys.executable, "-m", "jaxscale.train", *flags],
                                            cwd=REPO, stdout=out, stderr=err)

    def logged_step(self) -> int:
        """The newest step this process has logged (0: none yet)."""
        with open(self.log + ".out") as f:
            steps = [int(m[1]) for m in re.finditer(r"^step (\d+) \|", f.read(), re.M)]
        return max(steps, default=0)

    def wait_for_step(self, step: int) -> None:
        while self.logged_step() < step:
            if self.process.poll() is not None:
                with open(self.log + ".err") as f:
                    raise RuntimeError(f"the run ended before step {step}: {f.read()[-2000:]}")
            time.sleep(0.005)

    def restored_step(self) -> int:
        """The step this process resumed from (0: a fresh start)."""
        with open(self.log + ".out") as f:
            found = re.search(r"^restored (\S+)/(\d+) in", f.read(), re.M)
        return int(found[2]) if found else 0


def side(name: str, workdir: str, flags: list[str], kill_at: list[int], result: dict):
    """Trains `flags` to the end, killed once at each of `kill_at`, one round (a start to its
    kill, or to the end) per `next()`; fills `result` with what was lost."""
    lost_steps, lost_seconds, wall, killed_at = [], [], 0.0, None
    for starts, step in enumerate([*kill_at, None]):
        begin = time.perf_counter()
        run = Run(flags, os.path.join(workdir, f"{name}-{starts}"))
        if killed_at is not None:  # what the kill cost: restart, restore, the steps redone
            run.wait_for_step(killed_at)
            lost_seconds.append(time.perf_counter() - begin)
            lost_steps.append(killed_at - run.restored_step())
        if step is None:
            if run.process.wait() != 0:
                raise RuntimeError(f"{name} failed: see {run.log}.err")
        else:
            run.wait_for_step(step)
            run.process.send_signal(signal.SIGKILL)
            run.process.wait()
            killed_at = run.logged_step()
        wall += time.perf_counter() - begin
        yield
    with open(os.path.join(workdir, name, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    result.update(lost_steps=lost_steps, lost_seconds=lost_seconds, wall=wall,
                  step_time=statistics.median(line["step_time"] for line in lines
                                              if "step_time" in line))


def goodput(args, workdir: str) -> float:
    """Part 1; returns the ratio of the mean wall time lost per preemption."""
    rng = random.Random(args.seed)
    # Kills at least 3 steps apart, so that each lands after the restart has caught up.
    kill_at = sorted(rng.sample(range(5, args.steps - 5, 3), args.preemptions))
    cache = os.path.join(workdir, "compilation_cache")
    print(f"goodput: configs/tiny.py, {args.steps} steps, persistent every {args.every_steps}, "
          f"local every {args.local_every_steps}; SIGKILL at steps {kill_at} (seed {args.seed})",
          flush=True)
    # The same program as the sides' (the schedule's length is compiled in), stopped once it has
    # compiled and run its first step.
    warm = Run(train_flags(os.path.join(workdir, "warm"), args.steps, cache, {}),
               os.path.join(workdir, "warm"))
    warm.wait_for_step(1)
    warm.process.kill()
    warm.process.wait()
    sides = {
        "local+remote": dict(every_steps=args.every_steps, local_every_steps=args.local_every_steps,
                             local_dir=os.path.join(workdir, "local")),
        "remote-only": dict(every_steps=args.every_steps),
    }
    results = {name: {} for name in sides}
    rounds = [side(name, workdir, train_flags(os.path.join(workdir, name), args.steps, cache,
                                              checkpoint), kill_at, results[name])
              for name, checkpoint in sides.items()]
    for _ in range(len(kill_at) + 1):  # the sides take turns, a round each: the same load
        for turn in rounds:
            next(turn)
    for turn in rounds:
        next(turn, None)  # the rest: the sides' results
    for name, result in results.items():
        print(f"  {name}: lost steps {result['lost_steps']}, lost seconds "
              f"{[round(s, 1) for s in result['lost_seconds']]}; mean per preemption "
              f"{statistics.mean(result['lost_steps']):.1f} steps, "
              f"{statistics.mean(result['lost_seconds']):.2f} s; whole run {result['wall']:.1f} s "
              f"(median step {result['step_time']:.3f} s)", flush=True)
    return (statistics.mean(results["local+remote"]["lost_seconds"])
            / statistics.mean(results["remote-only"]["lost_seconds"]))


def blocking(args, workdir: str) -> None:
    """Part 2: prints the blocking and total times of local and persistent saves."""
    config = make_config(LARGE_MODEL)
    config.checkpoint.update(compilation_cache=False, keep=1, local_keep=1)
    trainer = Trainer(config, os.path.join(workdir, "large"))
    state = jax.block_until_ready(trainer.program.init_state(0))
    megabytes = state_megabytes(state)
    # A save copies the state off the devices (host memory on CPU), and a RAM disk holds it again.
    if args.local_root.startswith("/dev/shm") and available_megabytes() < 2.2 * megabytes:
        print(f"blocking: skipped: a {megabytes:.0f} MB save into a RAM disk needs about "
              f"{2.2 * megabytes:.0f} MB of memory more, {available_megabytes():.0f} MB are "
              "available")
        return
    data_state = make_input(config, "train", trainer.program.batch_sharding).get_state()
    timings = {tier: {"blocking": [], "total": []} for tier in (LOCAL, PERSISTENT)}
    roots = {LOCAL: args.local_root, PERSISTENT: args.remote_root or workdir}
    for repeat in range(args.blocking_repeats):
        for tier in (LOCAL, PERSISTENT):
            folder = tempfile.mkdtemp(prefix="jaxscale_goodput_", dir=roots[tier])
            config.checkpoint.update(dir=os.path.join(folder, "remote"),
                                     local_dir=os.path.join(folder, "local"))
            with Checkpoints(config, folder) as checkpoints:
                checkpoints.save(repeat, state, data_state, {"step": repeat}, tier=tier)
                checkpoints.wait()
                measured = checkpoints.take_metrics()
            shutil.rmtree(folder)
            prefix = "local_" if tier == LOCAL else ""
            timings[tier]["blocking"].append(measured[f"{prefix}checkpoint_blocking_seconds"])
            timings[tier]["total"].append(measured[f"{prefix}checkpoint_seconds"])
    print(f"blocking: a {megabytes:.0f} MB train state on {jax.device_count()} "
          f"{jax.devices()[0].device_kind} device(s), medians of {args.blocking_repeats}, each "
          "save into a fresh folder")
    for tier, label in ((LOCAL, f"local ({roots[LOCAL]})"),
                        (PERSISTENT, f"persistent ({roots[PERSISTENT]})")):
        print(f"  {label}: blocking {statistics.median(timings[tier]['blocking']):.3f} s, "
              f"total {statistics.median(timings[tier]['total']):.3f} s")


def available_megabytes() -> float:
    with open("/proc/meminfo") as f:
        return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M)[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--preemptions", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every_steps", type=int, default=40)
    parser.add_argument("--local_every_steps", type=int, default=4)
    parser.add_argument("--blocking_repeats", type=int, default=3, help="0: skip part 2")
    parser.add_argument("--local_root", default="/dev/shm")
    parser.add_argument("--remote_root", default=None, help="default: the workdir")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxscale_goodput_bench_")
    os.makedirs(workdir, exist_ok=True)
    ratio = goodput(args, workdir)
    if args.blocking_repeats:
        blocking(args, workdir)
    print(f"ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
