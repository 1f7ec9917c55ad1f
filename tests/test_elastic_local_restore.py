"""An elastic run (launch.local, 4 processes x 1 CPU device, --min_processes=3) saves to the local
tier every step and to the persistent one only at its end; process 2 is lost (SIGKILL) after step
5. The 3 survivors, renumbered 0..2, each find their own local folder by slot and restore the
newest local step all of them hold whole (data parallelism: a full replica each), onto the
3-process mesh, not step 0; every step's loss equals an uninterrupted 4-process run's to 1e-5
relative (float32)."""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, benchmark_module

pytestmark = pytest.mark.slow

elastic = benchmark_module("elastic")

STEPS, KILL_AFTER = 10, 5


def launch(workdir, cache, *flags):
    """launch.local on 4 processes of 1 device, `elastic.SMALL` trained STEPS steps with the local
    tier every step and no persistent checkpoint before the last step; output to
    `<workdir>.log`."""
    config = [flag for flag in elastic.SMALL
              if not flag.startswith(("--config.train.steps=", "--config.checkpoint.every_steps="))]
    with open(f"{workdir}.log", "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "jaxscale.launch.local", f"--processes={elastic.PROCESSES}",
             "--devices_per_process=1", "--grace_s=30", *flags, "--", *config,
             f"--config.train.steps={STEPS}", "--config.checkpoint.every_steps=1000",
             f"--config.checkpoint.local_dir={workdir}-local",
             "--config.checkpoint.local_every_steps=1",
             f"--config.checkpoint.compilation_cache_dir={cache}", f"--workdir={workdir}"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def test_a_lost_host_resumes_from_the_survivors_local_tier_with_unchanged_losses(tmp_path):
    cache, whole, lost = (str(tmp_path / name) for name in ("cache", "whole", "lost"))
    assert launch(whole, cache).wait() == 0, open(f"{whole}.log").read()[-3000:]

    proc = launch(lost, cache, f"--min_processes={elastic.PROCESSES - 1}")
    watcher = elastic.Watcher(lost)
    watcher.wait(proc, until_step=KILL_AFTER)
    elastic.kill_host(proc, elastic.VICTIM)
    watcher.wait(proc)
    output = open(f"{lost}.log").read()
    assert proc.returncode == 0, output[-3000:]
    went_on = output.index("launch.local: process(es) [2] lost (SIGKILL); going on with 3 of 4")
    # Process 0 of 3 reads its own folder (slot 0); a step saved locally, not step 0.
    restored = re.compile(rf"\[0\] restored {re.escape(lost)}-local/process_0/\w+/(\d+) in ")
    found = restored.search(output, went_on)
    assert found, output[went_on:went_on + 3000]
    assert 1 <= int(found.group(1)) <= KILL_AFTER
    # The survivor renumbered 2 (slot 3) saved in its own folder; the lost slot's has one layout.
    layouts = {slot: len(os.listdir(f"{lost}-local/process_{slot}")) for slot in range(4)}
    assert layouts == {0: 2, 1: 2, 2: 1, 3: 2}
    expected, got = elastic.metrics(whole), elastic.metrics(lost)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-5), step
