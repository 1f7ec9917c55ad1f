"""Stopping on a signal: preemption (SIGTERM, TPU maintenance) and Ctrl-C, agreed on by every
process.

Schedulers announce an eviction with SIGTERM (GKE, Slurm, spot VMs); TPU VMs announce maintenance
through JAX's preemption service; a person presses Ctrl-C. Every process must save the same step,
so the trainer asks `reached(step)` after each step and, on an answer, saves that step, waits until
the checkpoint is durable and raises the answer: `Preempted` (exit status 42, "restart me") or
`Interrupted` (exit status 130, the shell's status for Ctrl-C: supervisors do not restart it).

* multi-process runs use JAX's preemption sync manager (started by `jax.distributed.initialize`):
  it catches SIGTERM and maintenance notices on any process and answers at the same step on all
  of them. A Ctrl-C is turned into that same notice (a SIGTERM to this process), remembering that
  it was a Ctrl-C. JAX picks 1 + the highest count any process last passed, so nothing else may
  pass it a count (Orbax's managers are kept off it: tier.py), and the count is the steps of this
  start (1, 2, ...): the manager's count starts at 0, and a notice during start-up (restore,
  compile) would otherwise pick step 1, which a resumed run never passes. The notice reaches
  every process within about a second (JAX polls for SIGTERM once a second) and the run stops at
  the next step it begins after that;
* a single process catches both signals itself and stops after the step in flight.

A second Ctrl-C stops the process at once, without saving.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

import jax
from jax.experimental import multihost_utils

from jaxscale.errors import INTERRUPTED_EXIT_CODE, RESTART_EXIT_CODE
from jaxscale.runtime.agreement import everyone

logger = logging.getLogger(__name__)


class RunStopped(Exception):
    """The run saved (or tried to save) `step` and stopped on a signal; `exit_code` says what the
    CLI exits with. An ordinary exception, so a notebook calling `Trainer.run()` survives it."""
    exit_code: int

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class Preempted(RunStopped):
    """SIGTERM or maintenance: restart me (launchers start the run again from its checkpoint)."""
    exit_code = RESTART_EXIT_CODE


class Interrupted(RunStopped):
    """Ctrl-C: the user stopped the run; running the same command again resumes it."""
    exit_code = INTERRUPTED_EXIT_CODE


class StopSignals:
    """`with StopSignals() as signals: ... if (stop := signals.reached(step)): ...`"""

    def __init__(self):
        self._use_jax_service = jax.process_count() > 1
        self._stop: type[RunStopped] | None = None
        self._previous: dict[int, object] = {}
        self._before_start: int | None = None  # the step this start began at (`reached`)

    def __enter__(self) -> StopSignals:
        if self._use_jax_service:
            if not jax.config.jax_enable_preemption_service:
                logger.warning("jax_enable_preemption_service is off: a SIGTERM will stop this "
                               "run without a checkpoint")
        else:
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_sigterm(self, signum, frame) -> None:
        self._stop = self._stop or Preempted

    def _on_sigint(self, signum, frame) -> None:
        if self._stop is Interrupted:  # the second Ctrl-C: no saving, no clean-up, now
            print("\ninterrupted again: stopped at once, without saving", file=sys.stderr,
                  flush=True)
            os._exit(INTERRUPTED_EXIT_CODE)
        self._stop = Interrupted
        print("\ninterrupted: finishing the step in flight and saving a checkpoint "
              "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        if self._use_jax_service and jax.config.jax_enable_preemption_service:
            # JAX's service then picks a step that every process stops at.
            os.kill(os.getpid(), signal.SIGTERM)

    def reached(self, step: int) -> type[RunStopped] | None:
        """`Preempted` or `Interrupted` when the run should save `step` and stop, else None; the
        same answer on every process. Call it after every step, on every process, with steps in
        increasing order."""
        if not self._use_jax_service:
            return self._stop
        if self._before_start is None:
            self._before_start = step - 1
        try:
            if multihost_utils.reached_preemption_sync_point(step - self._before_start):
                # Every process is here: agree on why, so all exit alike (130 if anyone saw a
                # Ctrl-C, else 42).
                return Interrupted if everyone(self._stop is Interrupted).any() else Preempted
        except RuntimeError:  # the preemption service is off; warned about on entry
            pass
        return None
