"""The local-disk checkpoint faults again with the persistent tier in a `gs://` bucket
(fake-gcs-server, tests/storage_servers.py): SIGTERM and a bitwise resume, kill -9 in an async
save, two processes resumed on one, and the bucket deleted mid-run (issue 52, "Tests")."""

import os
import shutil
import signal
import time

import pytest

from jaxscale.errors import RESTART_EXIT_CODE, USAGE_EXIT_CODE
from jaxscale.runtime.storage import filesystem
from tests.fakes import fake_env
from tests.storage_servers import gcs  # noqa: F401 (fixture)
from tests.test_checkpoint_resume import flags, losses, start, train, wait_for_step
from tests.test_checkpoint_tiers_processes import finish, local_dir, preempt, reference, start_all
from tests.test_faults_checkpoint import LARGER_MODEL, merged_losses
from tests.test_faults_processes import no_process_left_behind  # noqa: F401 (fixture)
from tests.test_launch_training import losses as last_losses

pytestmark = pytest.mark.slow

# Orbax commits a save into a bucket by writing this object last (no rename in a bucket).
COMMIT_MARKER = "commit_success.txt"


def saves_in(url: str) -> tuple[list[int], list[int]]:
    """(complete steps, steps begun but not committed) of the checkpoints in bucket folder `url`,
    as the server lists them now."""
    fs, root = filesystem(url, "test")
    fs.invalidate_cache()
    objects = fs.find(root) if fs.exists(root) else []
    begun, committed = set(), set()
    for path in objects:
        step, _, rest = path.removeprefix(f"{root}/").partition("/")
        if step.isdigit():
            begun.add(int(step))
            if rest == COMMIT_MARKER:
                committed.add(int(step))
    return sorted(committed), sorted(begun - committed)


def test_a_run_in_gcs_stopped_by_sigterm_saves_there_and_resumes_bitwise(gcs, tmp_path):
    steps, run = 40, f"{gcs.bucket}/sigterm-{os.getpid()}"
    code, output = train(flags(tmp_path / "straight", steps))
    assert code == 0, output[-3000:]

    workdir = tmp_path / "resumed"
    process = start(flags(workdir, steps, dir=run, every_steps=1000))
    wait_for_step(process, workdir, 5)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == RESTART_EXIT_CODE, output[-3000:]
    stopped_at = max(losses(workdir))
    assert f"preempted at step {stopped_at}: checkpoint {run}/{stopped_at} saved; exiting to be " \
           "restarted" in output, output[-3000:]
    assert saves_in(run) == ([stopped_at], [])

    code, output = train(flags(workdir, steps, dir=run, every_steps=1000))
    assert code == 0, output[-3000:]
    assert f"restored {run}/{stopped_at}" in output
    assert losses(workdir) == losses(tmp_path / "straight")  # every step, bitwise


def test_kill_9_during_an_async_save_to_gcs_resumes_from_the_newest_complete_step(
        gcs, tmp_path):
    steps, run = 10, f"{gcs.bucket}/kill-{os.getpid()}"
    code, output = train(flags(tmp_path / "straight", steps, model=LARGER_MODEL))
    assert code == 0, output[-3000:]

    workdir = tmp_path / "run"
    args = flags(workdir, steps, model=LARGER_MODEL, dir=run, every_steps=1, keep=100)
    process = start(args)
    wait_for_step(process, workdir, 3)
    while not saves_in(run)[1]:  # a save begun and not committed: the kill lands inside it
        assert process.poll() is None, process.stdout.read()[-3000:]
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    complete, torn = saves_in(run)
    assert torn, "the kill missed the save; it must land inside one"
    assert complete and max(complete) < min(torn), (complete, torn)

    code, output = train(args)
    assert code == 0, output[-3000:]
    assert f"restored {run}/{complete[-1]} " in output, output[-3000:]
    # The torn save is incomplete, not damaged: nothing marked, and saved again on the way.
    assert "damaged" not in output
    fs, root = filesystem(run, "test")
    assert not [p for p in fs.ls(root, detail=False) if ".corrupt-" in p]
    assert saves_in(run) == (list(range(1, steps + 1)), [])
    assert merged_losses(workdir) == merged_losses(tmp_path / "straight")


def test_two_processes_saving_to_gcs_resume_on_one_from_the_bucket(
        gcs, tmp_path, tmp_path_factory):
    # Persistent saves (every 8 steps) to the bucket, local ones (every 2) on each process's
    # disk; process 1 is slowed so that the SIGTERM lands after the bucket holds step 8.
    reference_dir = reference(2, tmp_path_factory)
    run, workdir = f"{gcs.bucket}/two-{os.getpid()}", tmp_path / "run"
    procs = start_all(2, workdir, f"--config.checkpoint.dir={run}",
                      env=fake_env(tmp_path, slow_host=(1, 0.5)))
    while saves_in(run)[0] != [8]:
        assert procs[0].poll() is None, open(f"{workdir}_0.err").read()[-3000:]
        time.sleep(0.05)
    results = preempt(procs, workdir, after_step=9)
    assert [r[0] for r in results] == [RESTART_EXIT_CODE] * 2, results[0][2][-3000:]
    # Orbax removed a save's folder it found existing, with the arrays written into it (it did
    # in 2 runs of 4, then missing chunks failed the restore below): folders come first.
    for log in ("train.log", "train.process-1.log"):
        assert "Removing existing directory" not in (workdir / log).read_text(), log
    # One host takes the run over, with an empty local disk: only the bucket holds its state.
    shutil.rmtree(local_dir(workdir))
    results = finish(start_all(1, workdir, f"--config.checkpoint.dir={run}"), workdir)
    assert results[0][0] == 0, results[0][2][-3000:]
    assert f"restored {run}/8 " in results[0][1], results[0][1][-3000:]
    resumed, uninterrupted = last_losses(workdir), last_losses(reference_dir)
    assert sorted(resumed) == sorted(uninterrupted)
    for step in resumed:  # one process may sum the gradients in another order than two
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), step


def test_a_bucket_deleted_between_saves_stops_the_run_at_the_next_save(gcs, tmp_path,
                                                                      monkeypatch):
    # A bucket of its own, deleted once the save of 4 is committed; each step is slowed so that
    # the deletion lands before the save of 8, the run's last.
    bucket = f"gs://deleted-{os.getpid()}"
    fs, name = filesystem(bucket, "test")
    fs.mkdir(name)
    run = f"{bucket}/run"
    for variable, value in fake_env(tmp_path, slow_host=(0, 0.5)).items():
        monkeypatch.setenv(variable, value)
    workdir = tmp_path / "run"
    process = start(flags(workdir, 8, dir=run, every_steps=4))
    while saves_in(run)[0] != [4]:
        assert process.poll() is None, process.stdout.read()[-3000:]
        time.sleep(0.05)
    fs.rm(name, recursive=True)
    fs.invalidate_cache()
    assert not fs.exists(name)
    output, _ = process.communicate(timeout=300)
    # As a start with the bucket missing: exit 2 and its one line (before, exit 75 saying "the
    # checkpoints before it are intact and a restart resumes from the newest", gone as they were).
    assert process.returncode == USAGE_EXIT_CODE, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: checkpoint.dir={run!r}: bucket {bucket} does not exist, or this "
                      "account cannot see it; create it, or fix the path"], output[-3000:]
    assert "Traceback" not in output and max(losses(workdir)) == 8
