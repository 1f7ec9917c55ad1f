"""What a run shows on the terminal, and where the rest goes.

The terminal shows the run's own lines (jaxscale's prints and log records) and, when it fails,
the one `error: ...` line. What the libraries log (Orbax, TensorStore's Python side, asyncio,
absl, JAX), Python warnings, and the tracebacks of exceptions that no one could catch (raised in
a library's thread or callback, in a finalizer, at exit) go to `<workdir>/train.log` instead,
where a bug report finds them; with `--verbose` they are shown on the terminal too. A failing
save's Orbax threads log hundreds of traceback lines, which used to bury the one line that says
what to do.

    RunLog(verbose=False)               # the entry point, first thing
    ...
    open_file(workdir, process_index)   # once the run writes its workdir (the trainer)

It stays installed until the process ends: the tracebacks that bury the `error:` line are often
printed after it, while the process stops (Orbax's threads, at-exit flushes). Code that calls an
entry point's `main` in a process that goes on (tests) calls `close_active()` afterwards.
Until the workdir is written (a start that fails its checks writes nothing) the records wait in
memory; `open_file` writes them first. Process 0 writes `train.log`, process i
`train.process-<i>.log`. Nothing here is installed by importing it: Trainer used from Python
logs as before.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
import threading

from jaxscale.runtime.storage import writing
from jaxscale.runtime.workdir import WORKDIR_FIX

LOG_FILE = "train.log"
# Records kept in memory until the workdir is written; older ones are dropped past it.
_BUFFERED = 10_000
_FORMAT = "%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s"

_active: RunLog | None = None


def _own(record: logging.LogRecord) -> bool:
    return record.name == "jaxscale" or record.name.startswith("jaxscale.")


class _Buffer(logging.handlers.MemoryHandler):
    """Every record, held until `open_file` gives it a file (never flushed before)."""

    def __init__(self):
        super().__init__(_BUFFERED, flushLevel=logging.CRITICAL + 1)

    def shouldFlush(self, record: logging.LogRecord) -> bool:
        if self.target is None and len(self.buffer) >= self.capacity:
            del self.buffer[0]  # keep the newest
        return self.target is not None


class _LogFile(logging.FileHandler):
    """The log file, whose own write errors are dropped: when it cannot be written, the disk is
    full or failing, the run says so in its one `error:` line, and logging's report of each
    failed record (a traceback to the terminal) is what this module keeps off it."""

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class RunLog:
    """Installs the split between the terminal and the log file for one run of an entry point:
    handlers on the root logger, Python warnings captured, and hooks for uncaught exceptions
    outside the main thread and for unraisable ones. `close()` restores what was there."""

    def __init__(self, verbose: bool = False, stream=None):
        global _active
        close_active()
        self._stream = stream or sys.stderr
        self._root = logging.getLogger()
        self._saved = (list(self._root.handlers), self._root.level, sys.excepthook,
                       threading.excepthook, sys.unraisablehook)
        terminal = logging.StreamHandler(self._stream)
        terminal.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        if not verbose:
            terminal.addFilter(_own)
            terminal.setLevel(logging.WARNING)
        self._buffer = _Buffer()
        self._buffer.setLevel(logging.INFO)
        self._root.handlers = [terminal, self._buffer]
        self._root.setLevel(logging.INFO)
        logging.captureWarnings(True)
        sys.excepthook = self._excepthook
        threading.excepthook = self._thread_excepthook
        sys.unraisablehook = self._unraisablehook
        self._file: logging.Handler | None = None
        _active = self

    def open_file(self, workdir: str, process_index: int) -> str:
        """Writes the records so far, and every later one, to this process's log file in
        `workdir`; returns its path."""
        name = LOG_FILE if process_index == 0 else f"train.process-{process_index}.log"
        path = os.path.join(workdir, name)
        if self._file is None:
            with writing(path, WORKDIR_FIX):
                os.makedirs(workdir, exist_ok=True)
                self._file = _LogFile(path, encoding="utf-8")
            self._file.setFormatter(logging.Formatter(_FORMAT))
            self._buffer.setTarget(self._file)
            self._buffer.flush()
        return path

    def close(self) -> None:
        global _active
        self._buffer.close()
        if self._file is not None:
            self._file.close()
        logging.captureWarnings(False)
        handlers, level, sys.excepthook, threading.excepthook, sys.unraisablehook = self._saved
        self._root.handlers = handlers
        self._root.setLevel(level)
        _active = None

    def _excepthook(self, kind, value, traceback) -> None:
        # An uncaught exception of the main thread ends the process: a bug, shown where the user
        # looks. Elsewhere it comes from a library's callback (C code printing the error of a
        # Python callback it ran), which no one can catch.
        if threading.current_thread() is threading.main_thread():
            self._saved[2](kind, value, traceback)
        else:
            logging.getLogger("uncaught").error("in a callback", exc_info=(kind, value, traceback))

    def _thread_excepthook(self, args) -> None:
        name = args.thread.name if args.thread is not None else "a thread"
        logging.getLogger("uncaught").error(
            "in thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    def _unraisablehook(self, unraisable) -> None:
        where = unraisable.err_msg or "Exception ignored in"
        logging.getLogger("unraisable").error(
            "%s: %r", where, unraisable.object,
            exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))


def close_active() -> None:
    """Restores the logging and hooks that the active RunLog replaced, if one is active."""
    if _active is not None:
        _active.close()


def open_file(workdir: str, process_index: int) -> str | None:
    """The active run log's file in `workdir` (see RunLog.open_file); None when no entry point
    installed one."""
    return _active.open_file(workdir, process_index) if _active is not None else None
