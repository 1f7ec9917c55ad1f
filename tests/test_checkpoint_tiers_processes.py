"""Two tiers of checkpoints with real processes (2 or 4 `jaxscale.train` processes on simulated CPU
devices, gloo), each with its local folder (`<local_dir>/process_<i>`): a SIGTERM saves locally
and the restart resumes from there; a replaced host (its local folder wiped) resumes from the
persistent tier; a local save torn by kill -9 resumes from an older checkpoint; a local folder on
a full disk keeps the run going. Every resume's losses equal an uninterrupted run's, bitwise.

And how a failed persistent save ends with several processes: every process learns of it at the
same point and stops together, with the same line (a failed last save: 75; a full disk, after
three failed saves in a row: 2)."""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from jaxscale.errors import RESTART_EXIT_CODE, TRANSIENT_EXIT_CODE, USAGE_EXIT_CODE
from jaxscale.launch.local import free_port, process_env
from tests.fakes import fake_env
from tests.helpers import REPO

# Kills what a failed test left running (STARTED), as in that module.
from tests.test_faults_processes import (
    STARTED,
    last_line,
    no_process_left_behind,  # noqa: F401
    trainer_of,
)
from tests.test_launch_training import SMALL, losses

pytestmark = pytest.mark.slow

HEARTBEAT_S = 5
FLAGS = [*SMALL, "--config.checkpoint.every_steps=8", "--config.checkpoint.keep=100",
         "--config.checkpoint.local_every_steps=2", "--config.checkpoint.local_keep=2"]
# Makes writes fail in one process: "<process>:<errno>:<part>;<part>..." (see HOOK).
FAILING_WRITES_ENV = "JAXSCALE_TEST_FAILING_WRITES"
# The `sitecustomize` of every Python process of a test that injects failing writes (each
# jaxscale process runs its trainer in a child process of its own): on the process named by
# $JAXSCALE_TEST_FAILING_WRITES, every write through etils.epath (every checkpoint file but the
# arrays' own) to a path containing each of the parts fails with the errno.
HOOK = """
import os
process, _, rest = os.environ.get("JAXSCALE_TEST_FAILING_WRITES", "").partition(":")
if process and os.environ.get("JAX_PROCESS_ID") == process:
    from etils import epath
    number, _, parts = rest.partition(":")
    path_class = type(epath.Path("/"))
    real_open = path_class.open

    def failing_open(self, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+") and all(p in str(self) for p in parts.split(";")):
            raise OSError(int(number), os.strerror(int(number)), str(self))
        return real_open(self, mode, *args, **kwargs)
    path_class.open = failing_open
"""


def start_all(processes: int, workdir, *flags: str, failing_writes: str = "",
              heartbeat_s: float = HEARTBEAT_S, hook_dir=None,
              env: dict | None = None) -> list[subprocess.Popen]:
    """`processes` processes (4 devices in all) training FLAGS in `workdir` with their local tier
    in `local_dir(workdir)`; their output goes to files beside the workdir (`finish`)."""
    port = free_port()
    env = {**os.environ, **(env or {})}
    if failing_writes:
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        env.update(PYTHONPATH=f"{hook_dir}{os.pathsep}{REPO}", **{FAILING_WRITES_ENV:
                                                                   failing_writes})
    args = [*FLAGS, f"--workdir={workdir}", f"--config.checkpoint.local_dir={local_dir(workdir)}",
            f"--config.distributed.heartbeat_timeout_s={heartbeat_s}", *flags]
    started = []
    for i in range(processes):
        out, err = (open(log_file(workdir, i, kind), "w") for kind in ("out", "err"))
        with out, err:
            started.append(subprocess.Popen(
                [sys.executable, "-m", "jaxscale.train", *args], cwd=REPO,
                env=process_env(env, i, processes, 4 // processes, port), stdout=out, stderr=err,
                text=True))
    STARTED.extend(started)
    return started


def log_file(workdir, process, kind):
    """Where process `process` of the newest start in `workdir` writes its std`kind`."""
    return f"{workdir}_{process}.{kind}"


def finish(procs, workdir, timeout=300) -> list[tuple[int, str, str]]:
    """(status, stdout, stderr) of each process, once all have ended."""
    statuses = [p.wait(timeout=timeout) for p in procs]
    return [(status, *(open(log_file(workdir, i, kind)).read() for kind in ("out", "err")))
            for i, status in enumerate(statuses)]


def wait_for_step(process, workdir, step):
    """Waits until `process` (of `workdir`'s run) has logged `step`; fails if it ends first."""
    while not any(line.startswith(f"step {step} |")
                  for line in open(log_file(workdir, 0, "out")).read().splitlines()):
        assert process.poll() is None, open(log_file(workdir, 0, "err")).read()[-3000:]
        time.sleep(0.01)


def local_dir(workdir):
    return f"{workdir}_local"


def local_steps(workdir, process):
    """{layout folder: complete local steps} of `process`."""
    root = os.path.join(local_dir(workdir), f"process_{process}")
    return {layout: sorted(int(n) for n in os.listdir(os.path.join(root, layout)) if n.isdigit())
            for layout in os.listdir(root)}


_REFERENCES = {}


def reference(processes, tmp_path_factory):
    """The workdir of an uninterrupted run of `processes` processes (local tier on): its losses,
    and the compilation cache later runs of the same layout load instead of compiling."""
    if processes not in _REFERENCES:
        workdir = tmp_path_factory.mktemp(f"reference{processes}") / "run"
        results = finish(start_all(processes, workdir), workdir)
        assert [r[0] for r in results] == [0] * processes, results[0][2][-3000:]
        _REFERENCES[processes] = workdir
    return _REFERENCES[processes]


def cached(reference_dir):
    return f"--config.checkpoint.compilation_cache_dir={reference_dir}/compilation_cache"


def preempt(procs, workdir, after_step):
    """SIGTERM to process 0 once it has logged `after_step` (JAX's preemption service stops every
    process at the same step); returns (status, stdout, stderr) of each."""
    wait_for_step(procs[0], workdir, after_step)
    procs[0].send_signal(signal.SIGTERM)  # its guard passes it on to the trainer
    return finish(procs, workdir)


def stopped_at(stdout):
    (line,) = [line for line in stdout.splitlines() if line.startswith("preempted at step ")]
    return int(line.split()[3].rstrip(":")), line


@pytest.mark.parametrize("processes", [2, 4])
def test_a_preempted_run_saves_locally_and_resumes_from_local_exactly(
        processes, tmp_path, tmp_path_factory):
    reference_dir = reference(processes, tmp_path_factory)
    workdir = tmp_path / "run"
    results = preempt(start_all(processes, workdir, cached(reference_dir)), workdir,
                      after_step=5)
    assert [r[0] for r in results] == [RESTART_EXIT_CODE] * processes, results[0][2][-3000:]
    step, line = stopped_at(results[0][1])
    ((layout, _),) = local_steps(workdir, 0).items()
    local = f"{local_dir(workdir)}/process_0/{layout}"
    assert line == f"preempted at step {step}: checkpoint {local}/{step} saved; exiting to be " \
                   "restarted"
    for process in range(processes):
        assert step in list(local_steps(workdir, process).values())[0]

    results = finish(start_all(processes, workdir, cached(reference_dir)), workdir)
    assert [r[0] for r in results] == [0] * processes, results[0][2][-3000:]
    assert f"restored {local}/{step} " in results[0][1]
    assert losses(workdir) == losses(reference_dir)


def test_a_replaced_host_resumes_from_the_persistent_tier_exactly(tmp_path, tmp_path_factory):
    reference_dir = reference(2, tmp_path_factory)
    workdir = tmp_path / "run"
    # Process 1 sleeps 0.5 s a step, so that the kill lands before the last step.
    procs = start_all(2, workdir, cached(reference_dir),
                      env=fake_env(tmp_path, slow_host=(1, 0.5)))
    while not all(10 in held(workdir, process) for process in (0, 1)):
        assert procs[0].poll() is None, open(log_file(workdir, 0, "err")).read()[-3000:]
        time.sleep(0.01)
    os.kill(trainer_of(procs[0]), signal.SIGKILL)  # the host of process 0 is lost
    results = finish(procs, workdir)
    assert results[1][0] == TRANSIENT_EXIT_CODE, results[1][2][-3000:]
    assert sorted(n for n in os.listdir(workdir / "checkpoints") if n.isdigit()) == ["8"]
    shutil.rmtree(os.path.join(local_dir(workdir), "process_1"))  # a new host: an empty folder

    results = finish(start_all(2, workdir, cached(reference_dir)), workdir)
    assert [r[0] for r in results] == [0] * 2, results[0][2][-3000:]
    assert f"restored {workdir}/checkpoints/8 " in results[0][1]
    assert losses(workdir) == losses(reference_dir)
    # Process 0's local 10 lacked process 1's part: removed at the restart (then made again).
    assert "/10 removed: another process lacks its part" in results[0][2]


def held(workdir, process):
    """The complete local steps of `process`; [] before its first local save."""
    try:
        return [step for steps in local_steps(workdir, process).values() for step in steps]
    except FileNotFoundError:
        return []


def test_a_local_save_torn_by_kill_9_resumes_from_an_older_checkpoint_exactly(
        tmp_path, tmp_path_factory):
    reference_dir = reference(2, tmp_path_factory)
    workdir = tmp_path / "run"
    procs = start_all(2, workdir, cached(reference_dir), "--config.checkpoint.local_every_steps=1")
    wait_for_step(procs[0], workdir, 3)
    torn = os.path.join(local_dir(workdir), "process_0", "*", "*.orbax-checkpoint-tmp*")
    while not glob.glob(torn):
        assert procs[0].poll() is None, open(log_file(workdir, 0, "err")).read()[-3000:]
        time.sleep(0.002)
    os.kill(trainer_of(procs[0]), signal.SIGKILL)  # the coordinator: process 1 stops at once
    results = finish(procs, workdir)
    assert results[1][0] == TRANSIENT_EXIT_CODE, results[1][2][-3000:]
    assert glob.glob(torn), "the kill missed the save; it must land inside one"

    results = finish(start_all(2, workdir, cached(reference_dir),
                               "--config.checkpoint.local_every_steps=1"), workdir)
    assert [r[0] for r in results] == [0] * 2, results[0][2][-3000:]
    assert "restored " in results[0][1] and "damaged" not in results[0][2]
    assert losses(workdir) == losses(reference_dir)


def test_a_full_local_disk_on_one_host_keeps_the_run_going_and_warns_once(
        tmp_path, tmp_path_factory):
    reference_dir = reference(2, tmp_path_factory)
    workdir = tmp_path / "run"
    # Every write of process 1's local saves fails: its disk filled after the run started.
    failing = f"1:28:{local_dir(workdir)}/process_1/;.orbax-checkpoint-tmp"
    results = finish(start_all(2, workdir, cached(reference_dir), hook_dir=tmp_path,
                               failing_writes=failing), workdir)
    assert [r[0] for r in results] == [0] * 2, results[1][2][-3000:]
    warnings = [line for line in results[0][2].splitlines() if "local checkpoints are off" in line]
    assert len(warnings) == 1, results[0][2][-3000:]
    assert "(process 1: " in warnings[0] and "No space left on device" in warnings[0]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "8"]
    assert losses(workdir) == losses(reference_dir)


def test_a_last_save_failing_on_one_process_stops_both_together_with_its_line(
        tmp_path, tmp_path_factory):
    """Process 1 cannot write its part of the last checkpoint (EIO): both processes learn of it
    when they wait for it and exit 75 with the same line, long before JAX's heartbeat timeout
    would have stopped the one still waiting."""
    reference_dir = reference(2, tmp_path_factory)
    workdir = tmp_path / "run"
    procs = start_all(2, workdir, cached(reference_dir), hook_dir=tmp_path, heartbeat_s=100,
                      failing_writes=f"1:5:{workdir}/checkpoints/12.orbax-checkpoint-tmp")
    results = stopped_together(procs, workdir, TRANSIENT_EXIT_CODE)
    assert last_line(results[0][2]).startswith(
        f"error: checkpoint {workdir}/checkpoints/12 could not be written; the checkpoints before "
        "it are intact and a restart resumes from the newest (process 1: OSError: [Errno 5]")
    assert os.listdir(workdir / "checkpoints") != ["12"] and "8" in os.listdir(
        workdir / "checkpoints")


def test_a_full_disk_on_one_process_stops_both_with_exit_2_after_three_failed_saves(
        tmp_path, tmp_path_factory):
    """Every persistent save fails on process 1 (ENOSPC): saves 2 and 4 fail with a warning
    while the run goes on, the third (6) stops both processes together with exit 2 and the same
    line."""
    reference_dir = reference(2, tmp_path_factory)
    workdir = tmp_path / "run"
    procs = start_all(2, workdir, cached(reference_dir), "--config.checkpoint.every_steps=2",
                      "--config.checkpoint.local_every_steps=0", hook_dir=tmp_path,
                      heartbeat_s=100,
                      failing_writes=f"1:28:{workdir}/checkpoints/;.orbax-checkpoint-tmp")
    results = stopped_together(procs, workdir, USAGE_EXIT_CODE)
    assert last_line(results[0][2]).startswith(
        f"error: checkpoint {workdir}/checkpoints/6 could not be written: no space left "
        "(process 1: OSError: [Errno 28] No space left on device")
    assert "; 3 saves in a row failed; the checkpoints before it are intact" in last_line(
        results[0][2])
    assert [re.search(r"checkpoint (\S+) could not be written", line)[1]
            for line in results[0][2].splitlines() if "Training goes on" in line] == [
        f"{workdir}/checkpoints/{step}" for step in (2, 4)]
    assert not [name for name in os.listdir(workdir / "checkpoints") if name.isdigit()]


def stopped_together(procs, workdir, status) -> list[tuple[int, str, str]]:
    """(status, stdout, stderr) of each process, asserting that all ended with `status` and the
    same last line, within seconds of each other (JAX's heartbeat timeout is 100 s here)."""
    ended, deadline = {}, time.monotonic() + 300
    while len(ended) < len(procs):
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic()
        assert time.monotonic() < deadline, f"only {sorted(ended)} of the processes ended"
        time.sleep(0.05)
    results = finish(procs, workdir)
    assert [r[0] for r in results] == [status] * len(procs), results[0][2][-3000:]
    assert len({last_line(r[2]) for r in results}) == 1
    assert max(ended.values()) - min(ended.values()) < 20
    return results
