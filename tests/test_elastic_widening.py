"""A narrow run's stop saves persistently, so that the wider restart loses no step.

A run on 1 process of a range of 2 (JAXSCALE_MAX_PROCESSES=2, set by hand: no launcher involved),
the local tier every step and the persistent one never before the end, gets SIGTERM (as a
take-back sends): its stop saves the stop step to the persistent tier, not the local one, which
the returning host would not hold. The restart on 2 processes (launch.local) resumes from that
step: every step is logged once, and every loss equals an uninterrupted 2-process run's to 1e-5
relative (float32; the narrow run splits the same global batch in 2 microbatches). Before the fix
the restart found no local step on process 1 and no persistent one, and trained from step 0."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxscale.errors import RESTART_EXIT_CODE
from jaxscale.runtime.distributed import MAX_PROCESSES_VAR
from tests.helpers import REPO, benchmark_module

pytestmark = pytest.mark.slow

elastic = benchmark_module("elastic")

PROCESSES, STEPS, STOP_AFTER = 2, 6, 2


def training_flags(workdir, cache):
    """`elastic.SMALL` for STEPS steps, the local tier every step, no persistent save before the
    last step."""
    config = [flag for flag in elastic.SMALL
              if not flag.startswith(("--config.train.steps=", "--config.checkpoint.every_steps="))]
    return [*config, f"--config.train.steps={STEPS}", "--config.checkpoint.every_steps=1000",
            f"--config.checkpoint.local_dir={workdir}-local",
            "--config.checkpoint.local_every_steps=1",
            f"--config.checkpoint.compilation_cache_dir={cache}", f"--workdir={workdir}"]


def launch_wide(workdir, cache):
    """launch.local on PROCESSES processes of 1 device; (exit status, output)."""
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.launch.local", f"--processes={PROCESSES}",
         "--devices_per_process=1", "--", *training_flags(workdir, cache)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


def logged_losses(workdir):
    """{step: loss} from metrics.jsonl; fails when a step was logged twice (trained again)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        lines = [line for line in map(json.loads, f) if "loss" in line]
    steps = [line["step"] for line in lines]
    assert len(steps) == len(set(steps)), steps
    return {line["step"]: line["loss"] for line in lines}


def test_a_narrow_runs_stop_saves_persistently_and_the_wider_restart_redoes_no_step(tmp_path):
    cache, whole, widened = (str(tmp_path / name) for name in ("cache", "whole", "widened"))
    status, output = launch_wide(whole, cache)
    assert status == 0, output[-3000:]

    # One process of a range of 2, one device (the tests' 8 replaced).
    xla_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, MAX_PROCESSES_VAR: str(PROCESSES), "PYTHONUNBUFFERED": "1",
           "XLA_FLAGS": f"{xla_flags} --xla_force_host_platform_device_count=1"}
    narrow = subprocess.Popen([sys.executable, "-m", "jaxscale.train",
                               *training_flags(widened, cache)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(widened, "metrics.jsonl")
    while narrow.poll() is None and not (os.path.exists(metrics) and any(
            json.loads(line).get("step", 0) >= STOP_AFTER for line in open(metrics))):
        time.sleep(0.05)
    narrow.send_signal(signal.SIGTERM)
    output, _ = narrow.communicate(timeout=300)
    assert narrow.returncode == RESTART_EXIT_CODE, output[-3000:]
    assert "elastic: 1 of 2 devices, global batch 12 kept" in output
    stopped = re.search(r"preempted at step (\d+): checkpoint (\S+) saved", output)
    assert stopped, output[-3000:]
    step = int(stopped.group(1))
    assert STOP_AFTER <= step < STEPS
    assert stopped.group(2) == os.path.join(widened, "checkpoints", str(step))
    assert os.listdir(os.path.join(widened, "checkpoints")) == [str(step)]
    with open(os.path.join(widened, "train.log")) as f:  # why, in the run's log file
        assert "the run is on 1 of its range's 2 processes: its stop saves to " in f.read()

    status, output = launch_wide(widened, cache)
    assert status == 0, output[-3000:]
    assert f"[0] restored {widened}/checkpoints/{step} in " in output, output[-3000:]
    expected, got = logged_losses(whole), logged_losses(widened)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for s in expected:
        assert got[s] == pytest.approx(expected[s], rel=1e-5), s
