"""The barrier of Orbax's background save threads, which every process leaves when one of them
can never arrive.

Orbax finishes an async save in background threads that meet at barriers: every process has
written its shards (`async_write_complete`), process 0 has committed the folder, the save is no
longer in progress. When one process's write fails (ENOSPC, EIO), its thread skips the barriers
that follow the write and goes on to the one that marks the save as over: the processes now wait
at different barriers, and with JAX's own barrier they wait until Orbax's timeout (20 minutes).
Every later save and the end of the run wait behind them.

`SaveBarrier` is the `barrier_sync_fn` Orbax takes (`AsyncOptions`), built on the key-value store
of JAX's distributed runtime. While a process waits, it looks at where the others wait: when
every process waits and they wait at different barriers, none of which has completed, no process
can ever arrive where another waits, and every process raises `SaveAborted` from each barrier of
that save. No process commits the folder (the commit follows the barrier of the writes), every
thread ends, and `Checkpoints` learns each process's outcome: the process whose write failed
raises `SaveAborted` while handling its own error (`failure_behind`), the others a `SaveAborted`
of their own. The next save starts clean.
"""

from __future__ import annotations

import collections
import threading
import time

import jax
from jax._src import distributed  # the runtime's client, as Orbax's own barriers reach it

# How long a waiting process sleeps between looks at where the others wait.
POLL_MS = 500
_ROOT = "jaxscale_save"


class SaveAborted(Exception):
    """A save was stopped on this process because another process's save failed."""


def failure_behind(error: BaseException) -> BaseException | None:
    """The error that failed this process's own save, when `error` (what the save raised) is a
    `SaveAborted` raised while handling it; else None (`error` itself when it is no abort)."""
    seen = set()
    while isinstance(error, SaveAborted) and id(error) not in seen:
        seen.add(id(error))
        error = error.__context__
    return error


class SaveBarrier:
    """`barrier(key=..., timeout_ms=...)`, called by Orbax from every process's threads in the
    same order. Call `next_save()` on every process before each save: it keeps the barriers of
    one save apart from the next's (Orbax reuses some keys at every save)."""

    def __init__(self):
        self.generation = 0
        self._client = distributed.global_state.client
        self._processes = jax.process_count()
        self._process = jax.process_index()
        self._calls: collections.Counter = collections.Counter()
        self._lock = threading.Lock()  # Orbax calls from several threads

    def next_save(self) -> None:
        """The barriers from here on are the next save's. Every process has left those of the
        save before the previous one (each has finished the previous save, which needed them
        all): process 0 removes their keys."""
        self.generation += 1
        if self._process == 0 and self.generation > 2:
            self._client.key_value_delete(f"{_ROOT}/{self.generation - 2}/")

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        generation = self.generation
        with self._lock:
            calls = self._calls[generation, key]
            self._calls[generation, key] += 1
        barrier = f"{_ROOT}/{generation}/{key}#{calls}"
        aborted = f"{_ROOT}/{generation}/aborted"
        waiting = f"{_ROOT}/waiting/{self._process}"
        if self._get(aborted) is not None:
            raise SaveAborted(f"another process's save failed (at {key})")
        self._client.key_value_set(waiting, barrier, allow_overwrite=True)
        try:
            if self._client.key_value_increment(f"{barrier}/arrived", 1) == self._processes:
                self._client.key_value_set(f"{barrier}/done", "")
            deadline = time.monotonic() + timeout_ms / 1000
            while not self._wait_for(f"{barrier}/done", POLL_MS):
                if self._get(aborted) is not None:
                    raise SaveAborted(f"another process's save failed (at {key})")
                if self._never_met():
                    self._client.key_value_set(aborted, "", allow_overwrite=True)
                    raise SaveAborted(f"the processes wait at different barriers of this save "
                                      f"(this one at {key})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the processes did not all reach {key} within "
                                       f"{timeout_ms / 1000:g}s")
        finally:
            self._client.key_value_delete(waiting)

    def _never_met(self) -> bool:
        """Whether every process waits, at barriers that differ and that none has completed."""
        entries = self._client.key_value_dir_get(f"{_ROOT}/waiting/")
        where = {barrier for _, barrier in entries}
        return len(entries) == self._processes and len(where) > 1 and not any(
            self._get(f"{barrier}/done") is not None for barrier in where)

    def _get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except jax.errors.JaxRuntimeError as e:
            if "NOT_FOUND" in str(e):
                return None
            raise

    def _wait_for(self, key: str, timeout_ms: int) -> bool:
        try:
            self._client.blocking_key_value_get(key, timeout_ms)
            return True
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" in str(e):
                return False
            raise
