"""Faults writing the run's own files and opening its trackers (issue 45, items 1 and 2): each
is classified as a checkpoint's are (`runtime/storage.py`): a full or failing disk is transient
(exit 75), with one line naming the file; a refusal is the user's (exit 2). Trackers are opened
and checked before anything is written, and an unreachable tracking server fails in seconds.

A full disk is injected where Python meets the operating system (`open`'s file objects, `mkdir`),
for the files under one path only."""

import builtins
import errno
import io
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxscale.errors import ConfigError, TransientError
from jaxscale.observe import trackers
from jaxscale.observe.metrics import MetricsWriter
from jaxscale.observe.timing import RunClock
from jaxscale.runtime.workdir import open_workdir, set_aside_earlier_start
from tests.helpers import mesh_trainer, small_config
from tests.test_bad_inputs import run_in_process
from tests.test_faults_checkpoint import merged_losses, snapshot
from tests.test_trackers import REPO, offline  # noqa: F401 - a fixture


class _FailingFile:
    """A file whose writes and flushes fail with `disk.number` while `disk.on` is set."""

    def __init__(self, file, disk):
        self._file, self._disk = file, disk

    def _check(self):
        if self._disk.on:
            self._disk.failed.append(self._file.name)
            raise OSError(self._disk.number, os.strerror(self._disk.number))

    def write(self, data):
        self._check()
        return self._file.write(data)

    def flush(self):
        self._check()
        return self._file.flush()

    def close(self):
        try:
            self.flush()
        finally:
            self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getattr__(self, name):
        return getattr(self._file, name)


class FailingDisk:
    """While `on`, writes to files under `path` (and folders made there) fail with OSError
    (`number`): ENOSPC is a full disk, EACCES a refusal."""

    def __init__(self, monkeypatch, path, number):
        self.path, self.number, self.on, self.failed = str(path), number, False, []
        real_open, real_mkdir = builtins.open, os.mkdir

        def opening(file, mode="r", *args, **kwargs):
            opened = real_open(file, mode, *args, **kwargs)
            if isinstance(file, (str, os.PathLike)) and str(file).startswith(self.path) \
                    and any(c in mode for c in "wax+"):
                return _FailingFile(opened, self)
            return opened

        def making(folder, *args, **kwargs):
            if self.on and str(folder).startswith(self.path):
                self.failed.append(str(folder))
                raise OSError(self.number, os.strerror(self.number), str(folder))
            return real_mkdir(folder, *args, **kwargs)
        monkeypatch.setattr(builtins, "open", opening)
        monkeypatch.setattr(os, "mkdir", making)


def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def write_metrics(workdir, trackers_chosen):
    config = small_config()
    config.metrics.trackers = trackers_chosen
    with MetricsWriter(str(workdir), enabled=True, total_steps=4, config=config,
                       stream=io.StringIO()) as writer:
        writer.write(1, {"loss": 1.0})
        yield
        writer.write(2, {"loss": 0.5})


WRITES = {
    "config.json": (lambda workdir: open_workdir(str(workdir), "{}"), "config.json"),
    "run.json": (lambda workdir: RunClock(str(workdir), enabled=True), "run.json"),
    "earlier start": (lambda workdir: set_aside_earlier_start(str(workdir)), "earlier-"),
    "metrics.jsonl": (lambda workdir: write_metrics(workdir, ("jsonl",)), "metrics.jsonl"),
    "tensorboard": (lambda workdir: write_metrics(workdir, ("tensorboard",)), "tensorboard"),
}


def prepared(workdir, name):
    """The workdir as each write finds it: the earlier start's metrics to set aside, a
    MetricsWriter that wrote its first step (a generator: the second is written on resume)."""
    workdir.mkdir()
    if name == "earlier start":
        (workdir / "metrics.jsonl").write_text('{"step": 1}\n')
    write, _ = WRITES[name]
    result = write(workdir) if name in ("metrics.jsonl", "tensorboard") else None
    if result is not None:
        next(result)
    return lambda: next(result, None) if result is not None else write(workdir)


@pytest.mark.parametrize("number, raised", [(errno.ENOSPC, TransientError),
                                            (errno.EIO, TransientError),
                                            (errno.EACCES, ConfigError)],
                         ids=["ENOSPC", "EIO", "EACCES"])
@pytest.mark.parametrize("name", list(WRITES))
def test_a_failing_write_of_a_workdir_file_is_one_line_of_its_kind(
        tmp_path, monkeypatch, name, number, raised):
    workdir = tmp_path / "run"
    disk = FailingDisk(monkeypatch, workdir, number)
    write = prepared(workdir, name)
    disk.on = True
    with pytest.raises(raised) as error:
        write()
    disk.on = False  # the disk is back, for what still flushes at exit (tensorboardX does)
    message = one_line(error)
    assert disk.failed
    assert message.startswith(f"cannot write '{workdir}/{WRITES[name][1]}"), message
    if raised is TransientError:
        assert message.endswith(f"({os.strerror(number)}): the storage is failing"), message
    else:
        assert "access was denied" in message and "--workdir=" in message


@pytest.mark.slow
def test_a_full_disk_under_metrics_mid_run_exits_75_and_the_restart_trains_every_step(
        tmp_path, monkeypatch):
    """metrics.jsonl cannot be written from step 3: the run stops with a TransientError naming it
    (exit 75), the checkpoint of step 2 intact; the restart redoes steps 3-4, and the losses are
    those of a run never interrupted."""
    config = small_config()
    config.train.steps = 4
    config.optim.min_lr_ratio = 1.0
    config.checkpoint.update(every_steps=2, compilation_cache=False)
    straight = tmp_path / "straight"
    mesh_trainer(config, straight).run()

    workdir = tmp_path / "run"
    disk = FailingDisk(monkeypatch, workdir / "metrics.jsonl", errno.ENOSPC)
    trainer = mesh_trainer(config, workdir)
    real_write = MetricsWriter.write

    def full_from_step_3(writer, step, *args, **kwargs):
        disk.on = step >= 3
        return real_write(writer, step, *args, **kwargs)
    monkeypatch.setattr(MetricsWriter, "write", full_from_step_3)
    with pytest.raises(TransientError) as error:
        trainer.run()
    assert one_line(error) == (f"cannot write '{workdir}/metrics.jsonl' (No space left on "
                               "device): the storage is failing")
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
    before = snapshot(workdir / "checkpoints" / "2")

    monkeypatch.undo()  # the disk has room again
    mesh_trainer(config, workdir).run()
    assert snapshot(workdir / "checkpoints" / "2") == before
    assert merged_losses(workdir) == merged_losses(straight)


# --- trackers ----------------------------------------------------------------------------------

@pytest.fixture
def silent_server():
    """A tracking server's URL that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in accepted:
        connection.close()
    listener.close()


def mlflow_config(uri):
    config = small_config()
    config.metrics.update(trackers=("jsonl", "mlflow"), mlflow_tracking_uri=uri)
    return config


def test_a_tracking_server_that_does_not_answer_fails_in_seconds_with_75(
        tmp_path, monkeypatch, silent_server):
    """MLflow's own retries take 253 s; the start-up check waits TRACKER_TIMEOUT_S (here 1 s),
    then the run stops, exit 75, having written nothing. A real process: the check's thread,
    still waiting on the server, is not joined at exit (which held the process for MLflow's
    retries after the error line)."""
    pytest.importorskip("mlflow")
    monkeypatch.setattr(trackers, "TRACKER_TIMEOUT_S", 1.0)
    workdir = tmp_path / "run"
    begin = time.monotonic()
    with pytest.raises(TransientError) as error:
        trackers.check_tracker_access(mlflow_config(silent_server), str(workdir))
    assert time.monotonic() - begin < 30
    assert one_line(error) == (f"the MLflow tracking server {silent_server} did not answer "
                               "within 1 s")

    code = ("import sys; from jaxscale.observe import trackers; trackers.TRACKER_TIMEOUT_S = 1.0; "
            "from jaxscale.train import main; main(sys.argv)")
    result = subprocess.run(
        [sys.executable, "-c", code, "--config=configs/tiny.py", f"--workdir={workdir}",
         "--config.metrics.trackers=('jsonl','mlflow')",
         f"--config.metrics.mlflow_tracking_uri={silent_server}"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 75, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: the MLflow tracking server {silent_server} did not answer within 1 s "
        "(transient: exit 75, retry with backoff)"]
    assert not workdir.exists()


def test_a_wandb_server_that_does_not_answer_is_exit_75_not_a_refused_key(
        tmp_path, offline, monkeypatch, silent_server):  # noqa: F811 - the fixture
    """W&B reports a server that did not answer within WANDB_HTTP_TIMEOUT (10 s unless set) as
    an AuthenticationError, the error of a refused key; the check waits its own 30 s (here 3)
    for an answer, and no answer is transient."""
    pytest.importorskip("wandb")
    monkeypatch.setattr(trackers, "TRACKER_TIMEOUT_S", 3.0)
    monkeypatch.setenv("WANDB_BASE_URL", silent_server)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_HTTP_TIMEOUT", "1")  # W&B gives up first, as 10 s before 30
    config = small_config()
    config.metrics.update(trackers=("jsonl", "wandb"), wandb_mode="online")
    with pytest.raises(TransientError) as error:
        trackers.check_tracker_access(config, str(tmp_path / "run"))
    assert one_line(error) == "W&B's server did not answer within 3 s"
    assert os.environ["WANDB_HTTP_TIMEOUT"] == "1"  # the user's own, for the run
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("uri", ["htp://127.0.0.1:5000", "mlfow://tracking"])
def test_an_mlflow_uri_whose_scheme_mlflow_does_not_know_is_exit_2(tmp_path, uri):
    """No server could ever answer it: the user's to fix, not a transient failure retried."""
    pytest.importorskip("mlflow")
    with pytest.raises(ConfigError) as error:
        trackers.check_tracker_access(mlflow_config(uri), str(tmp_path / "run"))
    message = one_line(error)
    assert message.startswith(f"the MLflow tracking URI {uri!r} is not one MLflow can open (")
    assert message.endswith("; set metrics.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) to a "
                            "tracking server's http(s)://HOST:PORT, a folder, or file://PATH")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["under a regular file", "on a read-only disk"])
def test_an_mlflow_file_store_that_cannot_be_written_is_exit_2_before_anything_is_written(
        tmp_path, monkeypatch, where):
    pytest.importorskip("mlflow")
    notes = tmp_path / "notes.txt"
    notes.write_text("a file")
    uri = f"file://{notes}/mlruns"
    if where == "on a read-only disk":
        store = tmp_path / "store"
        store.mkdir()
        uri = f"file://{store}/mlruns"
        real_open = os.open

        def read_only(path, flags, *args, **kwargs):
            if str(path).startswith(str(store)) and flags & (os.O_WRONLY | os.O_RDWR):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
            return real_open(path, flags, *args, **kwargs)
        monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError) as error:
        trackers.check_tracker_access(mlflow_config(uri), str(tmp_path / "run"))
    message = one_line(error)
    assert message.startswith("the MLflow tracking URI's folder '") and "mlruns" in message
    assert ("is a file, not a folder" if where == "under a regular file"
            else "access was denied") in message
    assert "metrics.mlflow_tracking_uri" in message
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt"] + (
        ["store"] if where == "on a read-only disk" else []))


def test_online_wandb_without_a_key_stops_before_the_workdir_is_written(
        tmp_path, offline, monkeypatch, capfd):  # noqa: F811 - the fixture
    pytest.importorskip("wandb")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc holding a key
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    workdir = tmp_path / "run"
    status, out, err = run_in_process("jaxscale.train", [
        "--config=configs/tiny.py", f"--workdir={workdir}", "--config.train.steps=2",
        "--config.metrics.trackers=('jsonl','wandb')", "--config.metrics.wandb_mode=online"],
        capfd)
    assert status == 2, err
    assert err.strip().splitlines() == [
        "error: metrics.trackers includes 'wandb' in online mode but W&B has no API key; run "
        "`wandb login` (or set WANDB_API_KEY), or log offline with "
        "--config.metrics.wandb_mode=offline"]
    assert not workdir.exists()
