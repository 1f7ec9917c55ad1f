"""Elastic: what a lost host costs when the job goes on without it, against waiting for it.

    python benchmarks/elastic.py [--return_after_s=30] [--seed=0] [--workdir=DIR]

Trains a small tiny-shaped model (`SMALL`, float32, global batch 12, a persistent checkpoint every
2 steps) with `python -m jaxscale.launch.local` on 4 processes of 1 simulated CPU device, and kills
process `VICTIM` (its process group, SIGKILL: a lost host) once process 0 has logged a step drawn
from 3..STEPS-6 with --seed, in two ways:
- elastic: `--min_processes=3 --return_after_s=N`: the job goes on at once on 3 processes (the
  same global batch, in 2 microbatches) and takes the 4th back N s after the loss;
- waiting (today's): the launcher exits 75, and the run is started again on 4 processes once the
  host is back, N s after the loss.
Prints, for each: steps lost (trained again after the restore), seconds from the kill to the
first step after it, wall time to step STEPS, and last `ratio: X` = waiting's wall time /
elastic's. Both load their compiled programs from one compilation cache, warmed first by an
uninterrupted run (whose losses the test compares with).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from stops import process_pid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROCESSES = 4
VICTIM = 2
STEPS = 16
SMALL = ["--config=configs/tiny.py", f"--config.train.steps={STEPS}", "--config.train.log_every=1",
         "--config.train.seq_len=32", "--config.train.batch_size=12",
         "--config.train.eval_every=0", "--config.model.n_layers=1", "--config.model.d_model=64",
         "--config.model.n_heads=2", "--config.model.n_kv_heads=1", "--config.model.mlp_dim=128",
         "--config.precision.compute_dtype=float32", "--config.checkpoint.every_steps=2",
         "--config.checkpoint.keep=100"]
# Seconds from a lost host to the first step after it, elastic: the survivors killed at once, JAX
# and the trainer started again, the step compiled (or loaded) for 3, the restore; on a loaded
# 2-core machine.
RESUME_BOUND_S = 180
STEP_LINE = re.compile(r"^\[0\] step (\d+) \|", re.M)
# The returning process's line once it has written its arrival marker (runtime/arrivals.py), and
# the launcher's once the narrower run has stopped for it.
ARRIVED_LINE = re.compile(r"^\[returning \d+\] .*announced at ", re.M)
WIDER_LINE = re.compile(r"^launch.local: taking back the lost process", re.M)
# Seconds from the returning process's marker to the wider run's first step: process 0's next
# listing (runtime/arrivals.LIST_EVERY_S), the step JAX's preemption sync picks, the save, the
# restart on 4 and its start-up; on a loaded 2-core machine.
TAKE_BACK_BOUND_S = 120


class Run(NamedTuple):
    status: int  # the launcher's (the last one's, waiting)
    steps: list[tuple[float, int]]  # (time.monotonic(), step) of each step line process 0 logged
    started: float
    killed: float | None
    output: str
    arrived: float | None  # when the returning process announced itself
    widened: float | None  # when the launcher restarted on the full count

    def seconds_to_take_back(self) -> float:
        """From the returning process's marker to the wider run's first step."""
        return next(t for t, _ in self.steps if t >= self.widened) - self.arrived

    def steps_lost(self) -> int:
        """Steps trained again: those logged before the kill at or after the first step after it."""
        before = [s for t, s in self.steps if t < self.killed]
        after = [s for t, s in self.steps if t >= self.killed]
        return max(before) - min(after) + 1 if before and after else 0

    def seconds_to_resume(self) -> float:
        return next(t for t, _ in self.steps if t >= self.killed) - self.killed

    def wall_s(self) -> float:
        return next(t for t, s in self.steps if s == STEPS) - self.started


def launcher(workdir: str, cache: str, *flags: str, train_flags: tuple[str, ...] = ()
             ) -> subprocess.Popen:
    """launch.local on PROCESSES processes of 1 device in `workdir`, `train_flags` after SMALL;
    its output (process ids prefixed) is appended to `<workdir>.log`."""
    with open(f"{workdir}.log", "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "jaxscale.launch.local", f"--processes={PROCESSES}",
             "--devices_per_process=1", "--grace_s=30", *flags, "--", *SMALL, *train_flags,
             f"--config.checkpoint.compilation_cache_dir={cache}", f"--workdir={workdir}"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class Watcher:
    """Reads `<workdir>.log` as it grows and times each step line of process 0."""

    def __init__(self, workdir: str):
        self.path, self.read, self.steps = f"{workdir}.log", 0, []
        self.arrived = self.widened = None

    def poll(self) -> None:
        try:
            with open(self.path, errors="replace") as f:
                text = f.read()
        except FileNotFoundError:
            return
        now, whole = time.monotonic(), text.rfind("\n") + 1  # whole lines only
        self.steps += [(now, int(m.group(1))) for m in STEP_LINE.finditer(text, self.read, whole)]
        if self.arrived is None and ARRIVED_LINE.search(text, self.read, whole):
            self.arrived = now
        if self.widened is None and WIDER_LINE.search(text, self.read, whole):
            self.widened = now
        self.read = whole

    def wait(self, proc: subprocess.Popen, until_step: int | None = None) -> None:
        while proc.poll() is None and (until_step is None or not any(
                s >= until_step for _, s in self.steps)):
            self.poll()
            time.sleep(0.02)
        self.poll()


def kill_host(proc: subprocess.Popen, process_id: int) -> float:
    """SIGKILLs process `process_id` under launcher `proc` and its children (a lost host)."""
    os.killpg(process_pid(proc.pid, process_id), signal.SIGKILL)
    return time.monotonic()


def run(workdir: str, cache: str, kill_at: int | None, elastic: bool,
        return_after_s: float, min_processes: int = PROCESSES - 1,
        train_flags: tuple[str, ...] = ()) -> Run:
    """One run to STEPS in `workdir`: uninterrupted (`kill_at` None), or losing VICTIM once
    process 0 has logged step `kill_at`, elastic (a range from `min_processes`) or waiting."""
    shutil.rmtree(workdir, ignore_errors=True)  # afresh: a workdir left holds checkpoints
    if os.path.exists(f"{workdir}.log"):
        os.remove(f"{workdir}.log")
    watcher, started, killed = Watcher(workdir), time.monotonic(), None
    flags = ([f"--min_processes={min_processes}", f"--return_after_s={return_after_s}"]
             if elastic else [])
    proc = launcher(workdir, cache, *flags, train_flags=train_flags)
    if kill_at is not None:
        watcher.wait(proc, until_step=kill_at)
        killed = kill_host(proc, VICTIM)
    watcher.wait(proc)
    if kill_at is not None and not elastic and proc.returncode == 75:
        time.sleep(max(0.0, killed + return_after_s - time.monotonic()))  # the host comes back
        proc = launcher(workdir, cache, train_flags=train_flags)
        watcher.wait(proc)
    with open(f"{workdir}.log", errors="replace") as f:
        output = f.read()
    return Run(proc.returncode, watcher.steps, started, killed, output, watcher.arrived,
               watcher.widened)


def metrics(workdir: str) -> dict[int, dict]:
    """Each step's last logged metrics (a step trained again after a restore is logged again)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    return {line["step"]: line for line in lines if "loss" in line}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--return_after_s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="elastic-")
    cache = os.path.join(root, "compilation_cache")
    kill_at = random.Random(args.seed).randint(3, STEPS - 6)
    print(f"kill process {VICTIM} of {PROCESSES} after step {kill_at}; back after "
          f"{args.return_after_s:g} s")
    warm = run(os.path.join(root, "warm"), cache, None, False, 0)
    assert warm.status == 0, warm.output[-3000:]
    walls = {}
    for name, elastic in (("elastic", True), ("waiting", False)):
        r = run(os.path.join(root, name), cache, kill_at, elastic, args.return_after_s)
        assert r.status == 0, r.output[-3000:]
        walls[name] = r.wall_s()
        took_back = (f", returning host's marker to the wider run's first step "
                     f"{r.seconds_to_take_back():.1f} s" if r.widened is not None else "")
        print(f"{name:>8}: steps lost {r.steps_lost()}, kill to next step "
              f"{r.seconds_to_resume():.1f} s, wall to step {STEPS} {walls[name]:.1f} s"
              f"{took_back}")
    print(f"ratio: {walls['waiting'] / walls['elastic']:.2f}")


if __name__ == "__main__":
    main()
