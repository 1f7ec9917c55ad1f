"""Multi-host stops: does a preemption always end well? Random trials of a signal mid-run.

    python benchmarks/stops.py [--trials=20] [--processes=2] [--seed=0] [--workdir=DIR]

Each trial trains a small tiny-shaped model (`SMALL`, float32) with `python -m
jaxscale.launch.local` on `--processes` processes (4 simulated CPU devices in all, fsdp=4), 24
steps, a persistent checkpoint every 10, the local tier every step or off (drawn), and sends a
signal once process 0 has logged a step drawn from 3..14: SIGTERM to the launcher, SIGTERM to one
process (drawn), or SIGINT to the launcher (Ctrl-C). A trial ends well when the launcher and every
process exit with the stop's status (42, 130 for Ctrl-C) within `BOUND_S` of the signal, the run
stopped before its last step, and every process holds the checkpoint of the step process 0 says it
stopped at (its local copy with the local tier on, else the persistent one). All trials load their
compiled programs from one compilation cache, warmed by the first.

Prints a row per trial (processes, local tier, target, step signalled, step stopped, exit status,
seconds to exit, ended well) and last `ratio: X`, the fraction of trials that ended well.
"""

from __future__ import annotations

import argparse
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24
SMALL = ["--config=configs/tiny.py", f"--config.train.steps={STEPS}", "--config.train.log_every=1",
         "--config.train.seq_len=32", "--config.train.batch_size=8", "--config.train.eval_every=0",
         "--config.model.n_layers=1", "--config.model.d_model=64", "--config.model.n_heads=2",
         "--config.model.n_kv_heads=1", "--config.model.mlp_dim=128", "--config.mesh.data=1",
         "--config.mesh.fsdp=4", "--config.precision.compute_dtype=float32",
         "--config.checkpoint.every_steps=10", "--config.checkpoint.keep=100"]
# Seconds from the signal until every process has exited: JAX's SIGTERM poll (1 s), a step or
# two, a save made durable, teardown; on a loaded 2-core machine.
BOUND_S = 60
TARGETS = ("launcher", "process", "ctrl-c")


class Trial(NamedTuple):
    processes: int
    local: bool
    target: str  # one of TARGETS; "process" signals process `victim`
    at_step: int  # the signal goes once process 0 has logged this step
    victim: int = 1


class Outcome(NamedTuple):
    status: int  # the launcher's
    stopped: int | None  # the step process 0 said it stopped at
    seconds: float  # from the signal until the launcher had exited
    holders: list[bool]  # whether each process holds the checkpoint of `stopped`
    output: str

    def ended_well(self, trial: Trial) -> bool:
        expected = 130 if trial.target == "ctrl-c" else 42
        return (self.status == expected and self.stopped is not None
                and self.stopped < STEPS and self.seconds < BOUND_S and all(self.holders))


def launch(trial: Trial, workdir: str, cache: str, *flags: str,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """`trial`'s run in `workdir` under launch.local; its output (process ids prefixed) goes to
    `<workdir>.log`."""
    local = ([f"--config.checkpoint.local_dir={workdir}_local",
              "--config.checkpoint.local_every_steps=1"] if trial.local else [])
    with open(f"{workdir}.log", "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "jaxscale.launch.local", f"--processes={trial.processes}",
             f"--devices_per_process={4 // trial.processes}", "--grace_s=30", "--", *SMALL,
             *local, f"--config.checkpoint.compilation_cache_dir={cache}",
             f"--workdir={workdir}", *flags],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True)


def process_pid(launcher_pid: int, process_id: int) -> int:
    """The pid of process `process_id` under the launcher (its guard, which passes a SIGTERM on)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                if parent != launcher_pid:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"JAX_PROCESS_ID={process_id}".encode() in f.read().split(b"\0"):
                        return int(entry)
            except (OSError, IndexError):
                pass
    raise RuntimeError(f"no process {process_id} under launcher {launcher_pid}")


def run(trial: Trial, workdir: str, cache: str, env: dict[str, str] | None = None) -> Outcome:
    """Runs `trial` in `workdir` (made afresh) and reads how it ended."""
    for folder in (workdir, f"{workdir}_local"):
        shutil.rmtree(folder, ignore_errors=True)
    if os.path.exists(f"{workdir}.log"):
        os.remove(f"{workdir}.log")
    launcher = launch(trial, workdir, cache, env=env)
    mark = f"[0] step {trial.at_step} |"
    while launcher.poll() is None and mark not in _read(f"{workdir}.log"):
        time.sleep(0.02)
    signalled = time.monotonic()
    if launcher.poll() is None:
        if trial.target == "process":
            os.kill(process_pid(launcher.pid, trial.victim), signal.SIGTERM)
        else:
            launcher.send_signal(signal.SIGINT if trial.target == "ctrl-c" else signal.SIGTERM)
    try:
        status = launcher.wait(timeout=BOUND_S + 60)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        status = launcher.wait()
    seconds = time.monotonic() - signalled
    output = _read(f"{workdir}.log")
    found = re.search(r"^\[0\] (?:preempted|interrupted) at step (\d+):", output, re.M)
    stopped = int(found.group(1)) if found else None
    return Outcome(status, stopped, seconds, holders(trial, workdir, stopped), output)


def holders(trial: Trial, workdir: str, step: int | None) -> list[bool]:
    """Whether each process holds the checkpoint of `step`: its own local copy with the local tier,
    else its shards in the persistent one."""
    if step is None:
        return [False] * trial.processes
    if trial.local:
        return [any(os.path.isdir(os.path.join(workdir + "_local", f"process_{i}", layout,
                                               str(step)))
                    for layout in _listdir(os.path.join(workdir + "_local", f"process_{i}")))
                for i in range(trial.processes)]
    saved = os.path.join(workdir, "checkpoints", str(step), "params")
    return [os.path.isdir(os.path.join(saved, f"ocdbt.process_{i}"))
            for i in range(trial.processes)]


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _listdir(path: str) -> list[str]:
    return os.listdir(path) if os.path.isdir(path) else []


def draw(rng: random.Random, processes: int) -> Trial:
    target = rng.choice(TARGETS)
    return Trial(processes, rng.random() < 0.5, target, rng.randint(3, 14),
                 victim=rng.randrange(processes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--processes", type=int, choices=(2, 4), default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix="stops-")
    cache = os.path.join(root, "compilation_cache")
    rng = random.Random(args.seed)
    print(f"{'#':>3} {'procs':>5} {'local':>5} {'target':>10} {'signal':>6} {'stopped':>7} "
          f"{'status':>6} {'seconds':>7}  well")
    well = 0
    for n in range(args.trials):
        trial = draw(rng, args.processes)
        outcome = run(trial, os.path.join(root, "run"), cache)
        good = outcome.ended_well(trial)
        well += good
        target = f"process {trial.victim}" if trial.target == "process" else trial.target
        print(f"{n:>3} {trial.processes:>5} {'on' if trial.local else 'off':>5} {target:>10} "
              f"{trial.at_step:>6} {str(outcome.stopped):>7} {outcome.status:>6} "
              f"{outcome.seconds:>7.1f}  {'yes' if good else 'NO'}", flush=True)
        if not good:
            kept = os.path.join(root, f"failed-{n}.log")
            shutil.copy(os.path.join(root, "run.log"), kept)
            print(f"    output kept in {kept}", flush=True)
    print(f"ratio: {well / args.trials:.3f}")


if __name__ == "__main__":
    main()
