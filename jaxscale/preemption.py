"""Stopping to be restarted: SIGTERM and TPU maintenance events, agreed on by every process.

Schedulers announce an eviction with SIGTERM (GKE, Slurm, spot VMs); TPU VMs announce maintenance
through JAX's preemption service. Every process must save the same step, so the trainer asks
`reached(step)` after each step and, on True, saves that step, waits until the checkpoint is durable
and raises `Preempted`, which exits with `RESTART_EXIT_CODE`:

* multi-process runs use JAX's preemption sync manager (started by `jax.distributed.initialize`):
  it catches SIGTERM and maintenance notices on any process and answers True on all of them at the
  same step;
* a single process catches SIGTERM itself and stops after the step in flight.
"""

from __future__ import annotations

import logging
import signal

import jax
from jax.experimental import multihost_utils

from jaxscale.errors import RESTART_EXIT_CODE

logger = logging.getLogger(__name__)


class Preempted(SystemExit):
    """The run saved a checkpoint at `step` and stops to be restarted.

    A SystemExit carrying RESTART_EXIT_CODE: the CLI exits with that status and no traceback, and
    launchers (`jaxscale.supervise`, Slurm requeue, JobSet restart policies) start the run again.
    """

    def __init__(self, step: int):
        super().__init__(RESTART_EXIT_CODE)
        self.step = step


class PreemptionWatch:
    """`with PreemptionWatch() as preemption: ... if preemption.reached(step): ...`"""

    def __init__(self):
        self._use_jax_service = jax.process_count() > 1
        self._sigterm = False
        self._previous_handler = None

    def __enter__(self) -> PreemptionWatch:
        if not self._use_jax_service:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        elif not jax.config.jax_enable_preemption_service:
            logger.warning("jax_enable_preemption_service is off: a SIGTERM will stop this run "
                           "without a checkpoint")
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _on_sigterm(self, signum, frame) -> None:
        self._sigterm = True

    def reached(self, step: int) -> bool:
        """True when the run should save `step` and stop; the same answer on every process.

        Call it after every step, on every process, with steps in increasing order.
        """
        if not self._use_jax_service:
            return self._sigterm
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is off; warned about on entry
            return False
