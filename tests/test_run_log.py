"""What the terminal shows (issue 45, item 4): the run's own lines and the one `error:` line;
what libraries log, with their tracebacks, goes to <workdir>/train.log (and with --verbose to the
terminal too)."""

import errno
import gc
import io
import logging
import os
import subprocess
import sys
import threading
import warnings

import pytest

from jaxscale.observe.run_log import LOG_FILE, RunLog, close_active, open_file
from tests.helpers import REPO
from tests.test_checkpoint_resume import flags


@pytest.fixture
def terminal():
    stream = io.StringIO()
    yield stream
    close_active()


class _RaisesWhenCollected:
    def __del__(self):
        raise RuntimeError("a finalizer failed")


def library_noise():
    """What Orbax, asyncio and friends do when a save fails: an error logged with its traceback,
    an exception in a thread, one in a finalizer, a Python warning."""
    try:
        raise ValueError("OUT_OF_RANGE: Error writing in OCDBT database")
    except ValueError:
        logging.getLogger("absl").exception("_SignalingThread.run() raised an exception")
    thread = threading.Thread(target=lambda: 1 / 0, name="save_finalize")
    thread.start()
    thread.join()
    _RaisesWhenCollected()
    gc.collect()
    warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)


def test_library_logs_and_tracebacks_go_to_the_log_file_not_the_terminal(terminal, tmp_path):
    RunLog(stream=terminal)
    logging.getLogger("jaxscale.data.sources").warning("skipped malformed record 1 of at most 3")
    library_noise()
    assert terminal.getvalue() == "WARNING: skipped malformed record 1 of at most 3\n"

    # Records from before the workdir is written are kept for the file (a start that fails its
    # checks writes no file at all).
    path = open_file(str(tmp_path / "run"), 0)
    assert path == str(tmp_path / "run" / LOG_FILE)
    logging.getLogger("orbax").error("after the file opened")
    close_active()
    text = open(path, encoding="utf-8").read()
    for words in ("skipped malformed record", "_SignalingThread.run() raised an exception",
                  "ValueError: OUT_OF_RANGE", "in thread save_finalize", "ZeroDivisionError",
                  "RuntimeError: a finalizer failed", "a library's deprecation",
                  "after the file opened"):
        assert words in text, words


def test_verbose_shows_the_libraries_too(terminal):
    RunLog(verbose=True, stream=terminal)
    library_noise()
    shown = terminal.getvalue()
    assert "ValueError: OUT_OF_RANGE" in shown and "ZeroDivisionError" in shown


def test_close_restores_logging_and_the_hooks(terminal):
    saved = (list(logging.getLogger().handlers), sys.excepthook, threading.excepthook,
             sys.unraisablehook)
    RunLog(stream=terminal)
    assert sys.unraisablehook is not saved[3]
    close_active()
    assert (list(logging.getLogger().handlers), sys.excepthook, threading.excepthook,
            sys.unraisablehook) == saved


HOOK = """
import errno, os
import pytest
from etils import epath
from tests.test_faults_checkpoint import failing, writing
failing(pytest.MonkeyPatch(), "open", errno.ENOSPC, lambda path, mode="r": writing(mode) and (
    "/checkpoints/4.orbax-checkpoint-tmp" in path and path.endswith("/iterator.json")))
"""


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_a_full_disk_mid_save_shows_one_line_and_logs_the_tracebacks(tmp_path, verbose):
    """The save of step 4, the last, fails with ENOSPC (injected where Orbax opens its files):
    exit 2, as docs/checkpointing.md says (a restart would train to the same full disk); the
    terminal shows the run's lines and the `error:` line alone (on ff727fb, 494 to 676 lines
    of Orbax and asyncio tracebacks around it); train.log holds what Orbax logged."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", *flags(workdir, 4, compilation_cache=False),
         *(["--verbose"] if verbose else [])],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"})
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"[Errno {errno.ENOSPC}]" in errors[0], result.stderr[-3000:]
    log = (workdir / LOG_FILE).read_text()
    assert "Traceback" in log and "orbax" in log
    if verbose:
        assert "Traceback" in result.stderr
    else:
        assert [line for line in result.stderr.splitlines() if line.strip()] == errors
        assert "Traceback" not in result.stdout
