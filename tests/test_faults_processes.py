"""Faults of real processes (2 `jaxscale.train` processes x 2 simulated CPU devices, gloo): one
fails a start-up check, one is killed mid-run, the coordinator never starts, one starts 20 s late.
Each asserts the exit codes and that every checkpoint present before the fault is there after it,
byte for byte; after a kill, a restart resumes to the losses of an uninterrupted run."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxscale.errors import TRANSIENT_EXIT_CODE, USAGE_EXIT_CODE
from jaxscale.launch.local import free_port, process_env
from tests.fakes import SMALL_DEVICES_SAYS, fake_env
from tests.helpers import REPO
from tests.test_launch_training import SMALL, STEPS, children, losses
from tests.test_memory_check import listing

pytestmark = pytest.mark.slow

HEARTBEAT_S = 5
FLAGS = [*SMALL, "--config.checkpoint.every_steps=4", "--config.checkpoint.keep=100",
         f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}"]
LATE_S = 20
TRANSIENT_TAIL = f"(transient: exit {TRANSIENT_EXIT_CODE}, retry with backoff)"


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """A failed test may leave a process waiting for a peer: kill it (its guard's child dies with
    it)."""
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.wait()


def start(process_id: int, workdir, port: int, *flags: str, env=None) -> subprocess.Popen:
    """Process `process_id` of 2 training FLAGS in `workdir`."""
    STARTED.append(subprocess.Popen(
        [sys.executable, "-m", "jaxscale.train", *FLAGS, f"--workdir={workdir}", *flags],
        cwd=REPO, env=process_env({**os.environ, **(env or {})}, process_id, 2, 2, port),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return STARTED[-1]


def checkpoints(workdir) -> dict[str, str]:
    """`listing` of the committed checkpoints (Orbax renames a step's folder to its number when
    the step is saved)."""
    return {path: digest for path, digest in listing(os.path.join(workdir, "checkpoints")).items()
            if path.split(os.sep)[0].isdigit()}


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run in which process 1 starts 20 s after process 0; later runs take its
    compiled programs from its compilation cache. Returns (workdir, its processes' output)."""
    workdir = tmp_path_factory.mktemp("reference")
    port = free_port()
    first = start(0, workdir, port)
    time.sleep(LATE_S)
    late = start(1, workdir, port)
    outputs = [p.communicate(timeout=300) for p in (first, late)]
    assert [first.returncode, late.returncode] == [0, 0], outputs[0][1][-3000:]
    return workdir, outputs


def cached(reference_dir) -> str:
    return f"--config.checkpoint.compilation_cache_dir={reference_dir}/compilation_cache"


def test_a_process_that_starts_20_s_late_joins_the_run(reference):
    workdir, outputs = reference
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))
    assert f"done: step {STEPS}" in outputs[0][0]
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "4", "8"]


def test_a_start_up_check_failing_on_one_process_stops_both_with_its_line(reference, tmp_path):
    reference_dir = reference[0]
    for step in ("4", "8"):  # a run to resume from step 8: the restore is checked too
        shutil.copytree(reference_dir / "checkpoints" / step, tmp_path / "checkpoints" / step)
    before = listing(tmp_path)
    cache_before = listing(reference_dir / "compilation_cache")
    port = free_port()
    fakes = fake_env(tmp_path.parent / f"{tmp_path.name}-fakes", small_devices=1)
    procs = [start(i, tmp_path, port, cached(reference_dir), env=fakes) for i in (0, 1)]
    ended, deadline = {}, time.monotonic() + 120
    while len(ended) < 2:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic()
        assert time.monotonic() < deadline, f"only {sorted(ended)} of the processes ended"
        time.sleep(0.05)
    stderrs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [USAGE_EXIT_CODE] * 2, stderrs
    assert last_line(stderrs[0]) == last_line(stderrs[1])
    assert last_line(stderrs[0]).startswith(
        "error: process 1 of 2: the train step does not fit: per device it needs")
    assert f"({SMALL_DEVICES_SAYS})" in last_line(stderrs[0])
    assert abs(ended[0] - ended[1]) < 10  # together, not process 0 a heartbeat timeout later
    assert listing(tmp_path) == before  # nothing written, every checkpoint as it was
    assert listing(reference_dir / "compilation_cache") == cache_before


def wait_for_step(process: subprocess.Popen, step: int) -> None:
    for line in process.stdout:
        if line.startswith(f"step {step} |"):
            return
    raise AssertionError(f"process 0 ended before step {step}: {process.stderr.read()[-3000:]}")


def trainer_of(guard: subprocess.Popen) -> int:
    """The trainer's pid: a multi-process `jaxscale.train` (the guard) runs it as its child."""
    (trainer,) = children(guard.pid)
    return trainer


def kill_9_mid_run(victim: int, workdir, reference_dir, within_s: float) -> dict[str, str]:
    """Trains in `workdir` and kills process `victim`'s trainer at step 7, once checkpoint 4 is
    saved; asserts that the survivor exits 75 within `within_s` with one error line, and that the
    checkpoints saved before the kill are untouched. Returns them."""
    port = free_port()
    # Process 1 sleeps 0.5 s a step, so the kill lands mid-run.
    fakes = fake_env(workdir.parent / f"{workdir.name}-fakes", slow_host=(1, 0.5))
    procs = [start(i, workdir, port, cached(reference_dir), env=fakes) for i in (0, 1)]
    wait_for_step(procs[0], 7)
    before = checkpoints(workdir)
    assert {path.split(os.sep)[0] for path in before} == {"4"}
    os.kill(trainer_of(procs[victim]), signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = procs[1 - victim]
    _, stderr = survivor.communicate(timeout=within_s + 30)
    assert time.monotonic() - killed_at < within_s
    assert survivor.returncode == TRANSIENT_EXIT_CODE, stderr[-3000:]
    # Its collective fails on the closed socket, or JAX's service aborts it (the guard's line).
    assert re.match(f"error: process {1 - victim} (lost a peer in a collective|stopped: JAX's "
                    "distributed service reported)", last_line(stderr)), stderr[-3000:]
    assert last_line(stderr).endswith(TRANSIENT_TAIL)
    assert procs[victim].wait(timeout=30) == -signal.SIGKILL  # its guard died as it did
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    assert checkpoints(workdir) == before
    return before


def test_kill_9_of_a_process_ends_the_other_with_75_and_a_restart_resumes(reference, tmp_path):
    """Restarted after process 1 was killed, both resume from step 4 to an uninterrupted run's
    losses; the checkpoints saved before the kill are untouched throughout."""
    reference_dir = reference[0]
    # JAX notices the silence after the heartbeat timeout.
    before = kill_9_mid_run(1, tmp_path, reference_dir, within_s=HEARTBEAT_S + 30)
    port = free_port()
    restarted = [start(i, tmp_path, port, cached(reference_dir)) for i in (0, 1)]
    outputs = [p.communicate(timeout=300) for p in restarted]
    assert [p.returncode for p in restarted] == [0, 0], outputs[0][1][-3000:]
    assert f"restored {tmp_path}/checkpoints/4" in outputs[0][0]
    assert losses(tmp_path) == losses(reference_dir)  # every step, exactly
    after = checkpoints(tmp_path)
    assert {path: after[path] for path in before} == before


def test_kill_9_of_the_coordinator_ends_the_other_with_75_at_once(reference, tmp_path):
    # The coordination service dies with process 0: its peers' next poll fails, long before a
    # heartbeat timeout.
    kill_9_mid_run(0, tmp_path, reference[0], within_s=HEARTBEAT_S)


@pytest.mark.parametrize("alone, message", [
    (1, "error: process 1 of 2 could not reach process 0 (the coordinator) at 127.0.0.1:{port} "
        "before the timeout"),
    (0, "error: process 0 waited for the other 1 processes until the timeout, but process(es) "
        "[1] never arrived at the coordinator port {port}"),
], ids=["the coordinator never starts", "process 1 never starts"])
def test_a_peer_or_coordinator_that_never_starts_is_named_and_transient(tmp_path, alone,
                                                                        message):
    init_timeout_s = 5
    port = free_port()
    started = time.monotonic()
    process = start(alone, tmp_path / "run", port,
                    f"--config.distributed.init_timeout_s={init_timeout_s}")
    _, stderr = process.communicate(timeout=init_timeout_s + 60)
    # Start-up (JAX's import) on a loaded 2-core machine, then the wait.
    assert time.monotonic() - started < init_timeout_s + 45
    assert process.returncode == TRANSIENT_EXIT_CODE, stderr[-3000:]
    assert last_line(stderr).startswith(message.format(port=port))
    assert last_line(stderr).endswith(TRANSIENT_TAIL)
    assert not (tmp_path / "run").exists()
