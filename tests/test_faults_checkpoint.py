"""Faults around checkpoints, each real where this machine allows (files truncated, processes
killed) and injected where a disk cannot be made to fail (an OSError from etils.epath's `open`,
through which Orbax and jaxscale read and write every checkpoint file but the array data). Every
row asserts the outcome (exit code, or the exception that maps to it), that every checkpoint
present before is present after with the same names and bytes, and, where the run is to be
restarted, that the restarted run's losses equal those of a run never interrupted."""

import errno
import glob
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from etils import epath

from jaxscale.checkpoint import Checkpoints, restore_from, verdict
from jaxscale.checkpoint.manager import FAILED_SAVES_IN_A_ROW
from jaxscale.errors import TRANSIENT_EXIT_CODE, JaxscaleError, TransientError
from jaxscale.launch.local import free_port, process_env
from jaxscale.runtime.workdir import logged_metrics
from jaxscale.training.state import TrainState
from tests.helpers import REPO, mesh_trainer, small_config
from tests.test_checkpoint_resume import flags, one_error_line, start, train, wait_for_step

STEPS = 6  # the uninterrupted run; the interrupted one stopped after step 4, with checkpoints 2, 4


def config_for(steps):
    """The small model of `small_config`, a checkpoint every 2 steps, and a constant learning rate
    after one warmup step, so that a run stopped at step 4 and resumed to 6 takes the steps that a
    run of 6 takes."""
    config = small_config()
    config.train.steps = steps
    config.optim.min_lr_ratio = 1.0
    config.checkpoint.update(every_steps=2, compilation_cache=False)
    return config


def run(workdir, steps):
    """Trains in this process (Trainer.run(), as `python -m jaxscale.train` does)."""
    return mesh_trainer(config_for(steps), str(workdir)).run()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The losses of a run of STEPS steps that nothing interrupted."""
    workdir = tmp_path_factory.mktemp("straight")
    run(workdir, STEPS)
    return merged_losses(workdir)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The workdir of a run stopped after step 4: checkpoints 2 and 4."""
    workdir = tmp_path_factory.mktemp("stopped")
    run(workdir, 4)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    return workdir


@pytest.fixture
def workdir(stopped, tmp_path, monkeypatch):
    """A copy of the stopped run, restarted with retries that do not wait."""
    monkeypatch.setattr(verdict, "RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    shutil.copytree(stopped, tmp_path / "run")
    return tmp_path / "run"


def snapshot(directory):
    """{path relative to `directory`: sha256 of its bytes}, for every file under it."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def kept(before, after, renamed=None):
    """Whether every file of `before` is in `after` with the same bytes; `renamed` maps a
    checkpoint's new folder name to its old one."""
    renamed = renamed or {}

    def old_name(path):
        top, _, rest = path.partition("/")
        return f"{renamed.get(top, top)}/{rest}"
    return {old_name(k): v for k, v in after.items() if old_name(k) in before} == before


def merged_losses(workdir):
    """{step: loss} over every start of the run in `workdir`; a step logged by two starts (redone
    after a restart) has the same loss in both."""
    losses = {}
    for line in logged_metrics(str(workdir)):
        if "loss" in line:
            assert losses.setdefault(line["step"], line["loss"]) == line["loss"], line
    return losses


def failing(monkeypatch, method, error_number, fails):
    """etils.epath's `Path.<method>` raises OSError(error_number) when `fails(path, *args)`: how
    a failing disk or bucket looks to Orbax and jaxscale, which open every checkpoint file but
    the arrays' (TensorStore's) through `open`, and commit a save by `rename`. Returns the paths
    it failed."""
    path_class = type(epath.Path("/"))
    real = getattr(path_class, method)
    failed = []

    def failing_method(self, *args, **kwargs):
        if fails(str(self), *args):
            failed.append(str(self))
            raise OSError(error_number, os.strerror(error_number), str(self))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(path_class, method, failing_method)
    return failed


def refusing(monkeypatch, fails):
    """etils.epath's `Path.open` raises what gcsfs raises for HTTP 403 (an OSError without errno)
    when `fails(path, mode)`: a bucket this process's service account has no rights on."""
    path_class = type(epath.Path("/"))
    real = path_class.open

    def refusing_open(self, mode="r", *args, **kwargs):
        if fails(str(self), mode):
            raise OSError(f"Forbidden: {self}\nsa@p.iam.gserviceaccount.com does not have "
                          "storage.objects.get access")
        return real(self, mode, *args, **kwargs)
    monkeypatch.setattr(path_class, "open", refusing_open)


def writing(mode):
    return any(c in mode for c in "wax+")


def unfinished_saves(checkpoint_dir):
    """The folders of saves that never finished (Orbax renames a save's folder when it does)."""
    return glob.glob(os.path.join(checkpoint_dir, "*.orbax-checkpoint-tmp*"))


# -- reading ---------------------------------------------------------------------------------


def test_an_eio_on_the_first_read_is_retried_and_the_newest_checkpoint_restores(
        workdir, straight, monkeypatch, capsys, caplog):
    first = str(workdir / "checkpoints" / "4" / "params" / "_METADATA")
    failed = failing(monkeypatch, "open", errno.EIO, lambda path, mode="r": (
        path == first and not writing(mode) and not failed))
    before = snapshot(workdir / "checkpoints")

    run(workdir, STEPS)

    assert failed == [first]
    assert any("could not be read (OSError: [Errno 5] Input/output error" in r.getMessage()
               and "trying again" in r.getMessage() for r in caplog.records)
    assert f"restored {workdir}/checkpoints/4 " in capsys.readouterr().out
    assert kept(before, snapshot(workdir / "checkpoints"))
    assert merged_losses(workdir) == straight


def test_an_eio_on_every_read_exits_75_and_touches_no_checkpoint(workdir, straight, monkeypatch):
    checkpoints = str(workdir / "checkpoints")
    failed = failing(monkeypatch, "open", errno.EIO, lambda path, mode="r": (
        path.startswith(checkpoints) and not writing(mode)))
    before = snapshot(checkpoints)

    with pytest.raises(TransientError, match=rf"checkpoint {checkpoints}/4 could not be read "
                                             r"\(OSError: \[Errno 5\] Input/output error.*4 tries"):
        run(workdir, STEPS)
    assert failed
    assert snapshot(checkpoints) == before  # nothing renamed, deleted or written

    monkeypatch.undo()  # the storage is back: the restart resumes from 4
    run(workdir, STEPS)
    assert merged_losses(workdir) == straight


@pytest.mark.parametrize("how", ["truncated array file", "no commit record"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumes_exactly(
        workdir, straight, capsys, how):
    newest = workdir / "checkpoints" / "4"
    if how == "truncated array file":
        largest = max((p for p in (newest / "params").rglob("*") if p.parent.name == "d"),
                      key=lambda p: p.stat().st_size)
        os.truncate(largest, largest.stat().st_size // 2)
    else:  # what a folder holds before Orbax commits it (a copy of an unfinished save, say)
        record = json.loads((newest / "_CHECKPOINT_METADATA").read_text())
        del record["commit_timestamp_nsecs"]
        (newest / "_CHECKPOINT_METADATA").write_text(json.dumps(record))
    before = snapshot(workdir / "checkpoints")

    run(workdir, STEPS)

    assert f"restored {workdir}/checkpoints/2 " in capsys.readouterr().out
    names = sorted(os.listdir(workdir / "checkpoints"))
    set_aside = [name for name in names if name.startswith("4.corrupt-")]
    assert len(set_aside) == 1 and {"2", "4", "6"} <= set(names), names
    after = snapshot(workdir / "checkpoints")
    # Checkpoint 2 as it was; the damaged 4 byte for byte under its new name (4 and 6 are new).
    assert kept({k: v for k, v in before.items() if k.startswith("2/")}, after)
    assert kept({k: v for k, v in before.items() if k.startswith("4/")}, after,
                renamed={set_aside[0]: "4"})
    assert merged_losses(workdir) == straight


def test_every_checkpoint_damaged_is_one_error_line_exit_2_and_renames_none(workdir):
    os.remove(workdir / "checkpoints" / "2" / "_CHECKPOINT_METADATA")
    (workdir / "checkpoints" / "4" / "meta" / "metadata").write_text("{not json")
    before = snapshot(workdir / "checkpoints")

    error = one_error_line(*train(flags(workdir, STEPS)))  # exit 2, one line, no traceback

    assert f"every checkpoint in {workdir}/checkpoints is damaged (4: meta/metadata is not JSON" \
        in error
    assert "; 2: _CHECKPOINT_METADATA is missing); none was renamed" in error
    assert snapshot(workdir / "checkpoints") == before


def test_a_data_state_of_another_json_shape_is_damage_that_names_the_shape(workdir):
    for step in ("2", "4"):  # an array where the data iterator's state (an object) belongs
        (workdir / "checkpoints" / step / "data" / "iterator.json").write_text("[]\n")
    before = snapshot(workdir / "checkpoints")

    error = one_error_line(*train(flags(workdir, STEPS)))  # exit 2, one line, no traceback

    assert (f"every checkpoint in {workdir}/checkpoints is damaged (4: data/iterator.json is a "
            "JSON array, not an object; 2: data/iterator.json is a JSON array, not an object); "
            "none was renamed") in error
    assert snapshot(workdir / "checkpoints") == before


def test_restore_from_another_run_is_transient_when_unavailable_and_renames_no_damage(
        workdir, tmp_path, monkeypatch):
    trainer = mesh_trainer(config_for(STEPS), str(tmp_path / "new"))

    def restore():
        return restore_from(str(workdir), trainer.program.abstract_state, params_only=False,
                            model_config=trainer.program.model.config)
    failing(monkeypatch, "open", errno.EIO, lambda path, mode="r": path.startswith(str(workdir)))
    before = snapshot(workdir / "checkpoints")
    with pytest.raises(TransientError, match=rf"checkpoint.restore_from='{workdir}' could not be "
                                             r"read \(OSError: \[Errno 5\]"):
        restore()
    assert snapshot(workdir / "checkpoints") == before

    monkeypatch.undo()
    os.remove(workdir / "checkpoints" / "4" / "train" / "_METADATA")
    before = snapshot(workdir / "checkpoints")
    with pytest.raises(JaxscaleError, match=r"checkpoints/4 is damaged \(train/_METADATA is "
                                            r"missing\); point checkpoint.restore_from at another"):
        restore()
    assert snapshot(workdir / "checkpoints") == before
    program = trainer.program
    assert int(restore_from(str(workdir / "checkpoints" / "2"), program.abstract_state,
                            params_only=False, model_config=program.model.config).meta["step"]) == 2


@pytest.mark.parametrize("refusal", ["EACCES", "gcsfs 403"])
def test_a_checkpoint_the_storage_refuses_is_exit_2_at_once_and_touches_no_checkpoint(
        workdir, monkeypatch, caplog, refusal):
    checkpoints = str(workdir / "checkpoints")

    def fails(path, mode="r"):
        return path.startswith(checkpoints) and not writing(mode)
    if refusal == "EACCES":
        failing(monkeypatch, "open", errno.EACCES, fails)
    else:
        refusing(monkeypatch, fails)
    before = snapshot(checkpoints)

    with pytest.raises(JaxscaleError, match=rf"{checkpoints}/4/.*grant this process's user \(or "
                                            r"service account\) access, or point checkpoint.dir"):
        run(workdir, STEPS)
    assert not any("trying again" in r.getMessage() for r in caplog.records)  # never retried
    assert snapshot(checkpoints) == before  # nothing renamed, deleted or written


def test_a_save_the_storage_refuses_is_exit_2_and_the_checkpoints_before_it_are_intact(
        workdir, monkeypatch):
    checkpoints = workdir / "checkpoints"
    failed = failing(monkeypatch, "open", errno.EACCES, lambda path, mode="r": writing(mode) and (
        f"{checkpoints}/6.orbax-checkpoint-tmp" in path and path.endswith("/iterator.json")))
    before = snapshot(checkpoints)

    with pytest.raises(JaxscaleError, match=rf"checkpoint {checkpoints}/6 could not be written.*"
                                            r"Permission denied.*grant this process"):
        run(workdir, STEPS)
    assert failed
    assert kept(before, snapshot(checkpoints))


@pytest.mark.parametrize("error_number, raised", [(errno.EIO, TransientError),
                                                  (errno.EACCES, JaxscaleError)])
def test_a_failed_set_aside_says_which_damaged_checkpoints_it_renamed(
        tmp_path, monkeypatch, error_number, raised):
    monkeypatch.setattr(verdict, "RETRY_DELAYS_S", (0.0,))
    checkpoints_dir = tmp_path / "checkpoints"
    for step in (3, 2):
        (checkpoints_dir / str(step)).mkdir(parents=True)
    failing(monkeypatch, "rename", error_number, lambda path, target: path.endswith("/2"))
    checkpoints = Checkpoints(config_for(STEPS), str(tmp_path))

    with pytest.raises(raised, match=rf"damaged checkpoint {checkpoints_dir}/2 could not be "
                                     r"renamed .*; renamed before it: 3 to "
                                     r"3\.corrupt-\d+$"):
        checkpoints.persistent.set_aside({3: "truncated", 2: "truncated"}, f"{checkpoints_dir}/1")
    names = sorted(os.listdir(checkpoints_dir))
    assert names[0] == "2" and names[1].startswith("3.corrupt-"), names


# -- saving ----------------------------------------------------------------------------------


@pytest.mark.parametrize("error_number, raised, words", [
    (errno.EIO, TransientError, "; the checkpoints before it are intact .*Input/output error"),
    (errno.ENOSPC, JaxscaleError, ": no space left .*No space left on device.*; the checkpoints "
                                  "before it are intact. Free space in")])
def test_a_failed_last_save_stops_the_run_and_the_restart_resumes_exactly(
        workdir, straight, monkeypatch, error_number, raised, words):
    """The last step's save fails in the background: the run cannot go on without it. A full disk
    is exit 2 (a restart would train to the same full disk), any other storage error 75."""
    checkpoints = workdir / "checkpoints"
    failed = failing(monkeypatch, "open", error_number, lambda path, mode="r": writing(mode) and (
        f"{checkpoints}/6.orbax-checkpoint-tmp" in path and path.endswith("/iterator.json")))
    before = snapshot(checkpoints)

    with pytest.raises(raised, match=rf"^checkpoint {checkpoints}/6 could not be written{words}"):
        run(workdir, STEPS)
    assert failed
    assert kept(before, snapshot(checkpoints))
    assert unfinished_saves(checkpoints) and not (checkpoints / "6").exists()

    monkeypatch.undo()
    run(workdir, STEPS)  # resumes from 4; the unfinished save's folder is removed
    assert not unfinished_saves(checkpoints)
    assert merged_losses(workdir) == straight


def file_size_limit(limit):
    """A `preexec_fn` that caps the size of every file the process writes at `limit` bytes: a
    write past it fails with EFBIG (SIGXFSZ, which would kill the process instead, is ignored)."""
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


@pytest.mark.slow
def test_a_real_write_error_in_an_async_save_exits_75_and_the_restart_resumes_exactly(tmp_path):
    """No injection: the kernel refuses TensorStore's writes of the arrays (EFBIG), in the
    background of a `python -m jaxscale.train` process."""
    def args(workdir, steps):  # as `config_for`: a run of 4 steps resumed to 6 is a run of 6
        return [*flags(workdir, steps, compilation_cache=False), "--config.optim.warmup_steps=1",
                "--config.optim.min_lr_ratio=1.0"]
    straight_dir, workdir = tmp_path / "straight", tmp_path / "run"
    for directory, steps in ((straight_dir, STEPS), (workdir, 4)):
        code, output = train(args(directory, steps))
        assert code == 0, output[-3000:]
    checkpoints = workdir / "checkpoints"
    before = snapshot(checkpoints)
    # Above every metadata, metrics and event file of a run of this model; below its arrays'.
    result = subprocess.run([sys.executable, "-m", "jaxscale.train", *args(workdir, STEPS)],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            preexec_fn=file_size_limit(64 * 1024))

    output = result.stdout + result.stderr
    assert result.returncode == TRANSIENT_EXIT_CODE, output[-3000:]
    # One line from jaxscale (Orbax logs the failed writes of its threads, tracebacks included).
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    assert f"checkpoint {checkpoints}/6 could not be written; the checkpoints before it are " \
        "intact" in errors[0] and "File too large" in errors[0], errors
    assert kept(before, snapshot(checkpoints))
    assert unfinished_saves(checkpoints) and not (checkpoints / "6").exists()

    code, output = train(args(workdir, STEPS))
    assert code == 0, output[-3000:]
    assert f"restored {checkpoints}/4 " in output
    assert merged_losses(workdir) == merged_losses(straight_dir)


def tiny_state(value):
    """A TrainState of a few host arrays: saved and restored without compiling anything."""
    weights = np.full(4, value, np.float32)
    return TrainState(step=np.array(value, np.int32), params={"w": weights},
                      opt_state={"m": weights * 2}, loss_scale=np.array(1, np.float32),
                      good_steps=np.array(0, np.int32))


def fail_the_commit_of(monkeypatch, checkpoints_dir, steps, error_number):
    """The commit (the rename once every item is written) of `steps` fails with `error_number`:
    a failure earlier leaves TensorStore writing into the folder a moment longer, which a restart
    in this same process would race when it saves that step again (a restarted process has
    none)."""
    return failing(monkeypatch, "rename", error_number, lambda path, target: any(
        path.startswith(f"{checkpoints_dir}/{step}.orbax-checkpoint-tmp")
        and str(target) == f"{checkpoints_dir}/{step}" for step in steps))


@pytest.mark.parametrize("surfaces_in", ["wait", "close", "a synchronous save"])
def test_a_failed_save_the_run_cannot_go_on_without_is_transient(tmp_path, monkeypatch,
                                                                  surfaces_in):
    config = config_for(STEPS)
    checkpoints_dir = tmp_path / "checkpoints"
    synchronous = surfaces_in == "a synchronous save"
    fail_the_commit_of(monkeypatch, checkpoints_dir, [2], errno.EIO)
    checkpoints = Checkpoints(config, str(tmp_path), async_save=not synchronous)
    checkpoints.save(1, tiny_state(1), {"position": 1}, {"step": 1})
    checkpoints.wait()
    before = snapshot(checkpoints_dir)

    message = rf"checkpoint {checkpoints_dir}/2 could not be written.*Input/output error"
    with pytest.raises(TransientError, match=message):
        checkpoints.save(2, tiny_state(2), {"position": 2}, {"step": 2})
        assert not synchronous  # an async save returns: the error surfaces later
        if surfaces_in == "wait":
            checkpoints.wait()
        else:
            checkpoints.close()
    checkpoints.close()  # raised once: closing after it is quiet
    assert kept(before, snapshot(checkpoints_dir))
    assert unfinished_saves(checkpoints_dir) and not (checkpoints_dir / "2").exists()

    monkeypatch.undo()
    with Checkpoints(config, str(tmp_path)) as restarted:  # the next start resumes from 1
        restored = restarted.restore_newest(tiny_state(0))
        # Orbax removes the unfinished folder before the first save of a start.
        restarted.save(2, tiny_state(2), {"position": 2}, {"step": 2})
    assert restored.meta == {"step": 1} and restored.data_state == {"position": 1}
    np.testing.assert_array_equal(restored.params["w"], np.full(4, 1, np.float32))
    assert sorted(os.listdir(checkpoints_dir)) == ["1", "2"]


@pytest.mark.parametrize("error_number, raised", [(errno.ENOSPC, JaxscaleError),
                                                  (errno.EIO, TransientError)])
def test_failed_saves_are_tried_again_and_the_third_in_a_row_stops_the_run(
        tmp_path, monkeypatch, caplog, error_number, raised):
    """Saves 2, 4, 5 and 6 fail, each surfacing at the next save: the first three with a warning
    while the run goes on (3 succeeds in between and starts the count again), the third in a row
    (6) stops it: ENOSPC with exit 2 (a person must make room), EIO with 75."""
    checkpoints_dir = tmp_path / "checkpoints"
    fail_the_commit_of(monkeypatch, checkpoints_dir, [2, 4, 5, 6], error_number)
    checkpoints = Checkpoints(config_for(STEPS), str(tmp_path))
    with caplog.at_level(logging.WARNING, "jaxscale"):
        for step in range(1, 7):
            assert checkpoints.save(step, tiny_state(step), {"position": step}, {"step": step})
    warnings = [r.getMessage() for r in caplog.records if "Training goes on" in r.getMessage()]
    assert [w.split(" could not")[0] for w in warnings] == [
        f"checkpoint {checkpoints_dir}/{step}" for step in (2, 4, 5)]
    assert "(1 failed in a row; 3 stop the run)" in warnings[1]
    assert "(2 failed in a row; 3 stop the run)" in warnings[2]
    with pytest.raises(raised, match=rf"^checkpoint {checkpoints_dir}/6 could not be written.*"
                                     r"; 3 saves in a row failed"):
        checkpoints.save(7, tiny_state(7), {"position": 7}, {"step": 7})
    checkpoints.close()
    assert sorted(name for name in os.listdir(checkpoints_dir) if name.isdigit()) == ["1", "3"]


def test_the_readme_says_what_failed_saves_and_a_full_disk_do():
    """As the test above and docs/checkpointing.md: README said a full disk exits 75."""
    assert FAILED_SAVES_IN_A_ROW == 3
    readme = " ".join((Path(REPO) / "README.md").read_text(encoding="utf-8").split())
    assert ("three failed saves in a row stop the run with one `error:` line, exit 75, or exit 2 "
            "when the disk is full") in readme
    assert "EIO, a full disk) or a tracking server" not in readme


# Big enough that writing a checkpoint takes a while, so the kill lands in the middle of one.
LARGER_MODEL = dict(n_layers=4, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, mlp_dim=768)


@pytest.mark.slow
def test_kill_9_during_an_async_save_loses_only_that_save_and_resumes_exactly(tmp_path):
    # The kill lands in the first save still being written from step 3 on (one a step); the
    # steps after it are there to resume through, and each one's save costs seconds.
    steps = 10
    code, output = train(flags(tmp_path / "straight", steps, model=LARGER_MODEL))
    assert code == 0, output[-3000:]
    straight_losses = merged_losses(tmp_path / "straight")

    workdir, checkpoint_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    args = flags(workdir, steps, model=LARGER_MODEL, every_steps=1, keep=100)
    process = start(args)
    wait_for_step(process, workdir, 3)
    while not unfinished_saves(checkpoint_dir):
        assert process.poll() is None, process.stdout.read()[-3000:]
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert unfinished_saves(checkpoint_dir), "the kill missed the save; it must land inside one"
    complete = sorted(int(name) for name in os.listdir(checkpoint_dir) if name.isdigit())
    assert complete
    before = {name: snapshot(checkpoint_dir / name) for name in map(str, complete)}

    code, output = train(args)
    assert code == 0, output[-3000:]
    assert f"restored {checkpoint_dir}/{complete[-1]} " in output
    assert "damaged" not in output
    assert not unfinished_saves(checkpoint_dir)
    # Every checkpoint written before the kill is still there, byte for byte (keep=100).
    assert {name: snapshot(checkpoint_dir / name) for name in before} == before
    assert merged_losses(workdir) == straight_losses


FAILING_READS_ENV = "JAXSCALE_TEST_FAILING_READS"


def inject_faults_from_env():
    """Run at the start of every Python process of the two-process test, by a `sitecustomize`
    (each jaxscale process runs its work in a child process of its own): retries that do not
    wait and, on process 1, every read under $JAXSCALE_TEST_FAILING_READS failing with EIO."""
    monkeypatch = pytest.MonkeyPatch()  # never undone: it lasts as long as the process
    monkeypatch.setattr(verdict, "RETRY_DELAYS_S", (0.0, 0.0, 0.0))
    if os.environ.get("JAX_PROCESS_ID") == "1":
        directory = os.environ[FAILING_READS_ENV]
        failing(monkeypatch, "open", errno.EIO, lambda path, mode="r": (
            path.startswith(directory) and not writing(mode)))


@pytest.mark.slow
def test_two_processes_agree_a_checkpoint_one_cannot_read_is_unavailable(workdir, tmp_path):
    """Process 1 fails every read of the checkpoints (EIO); process 0 reads them well. Both exit
    75 with the same line naming process 1's error, and no checkpoint is touched."""
    checkpoints = workdir / "checkpoints"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "from tests.test_faults_checkpoint import inject_faults_from_env\n"
        "inject_faults_from_env()\n")
    before = snapshot(checkpoints)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}",
           FAILING_READS_ENV: str(checkpoints)}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "jaxscale.train", *flags(workdir, STEPS)], cwd=REPO,
        env=process_env(env, i, 2, devices=4, port=port), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outputs = [process.communicate(timeout=300)[0] for process in processes]

    errors = []
    for process, output in zip(processes, outputs):
        assert process.returncode == TRANSIENT_EXIT_CODE, output[-3000:]
        errors += [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and errors[0] == errors[1], outputs
    assert (f"checkpoint {checkpoints}/4 could not be read (process 1: OSError: [Errno 5] "
            "Input/output error") in errors[0]
    assert snapshot(checkpoints) == before
