"""`python -m jaxscale.train --config=configs/NAME.py --workdir=DIR [--config.KEY=VALUE ...]`

Trains a config: restores the newest checkpoint in DIR (or starts fresh), trains to
train.steps, logs metrics and saves checkpoints. Ctrl-C saves and stops (exit 130; run the same
command again to resume); SIGTERM saves and exits 42 ("restart me"). A mistake the user can fix
prints one `error: ...` line and exits with status 2, before anything is compiled or written; a
transient infrastructure failure (storage, coordinator, a peer) prints one `error: ...` line and
exits 75 ("retry with backoff"), every checkpoint left where it was. What libraries log (Orbax, JAX,
absl, with their tracebacks) goes to DIR/train.log, with --verbose to the terminal too. One of
several processes runs the trainer as its child (runtime.distributed.guard): when JAX stops it
because the run lost a process (a crash, `kill -9`, a lost host) it exits 75 too. With mesh.auto the
planner chooses the layout first (jaxscale/plan/auto.py) and the trainer runs the step it compiled.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time

from jaxscale.cli import fail_with, parse_train_command
from jaxscale.errors import INTERRUPTED_EXIT_CODE, JaxscaleError, TransientError


def _stop_at_once(signum, frame) -> None:
    # Outside the training loop (start-up checks, imports, the final clean-up) nothing is left to
    # save, and a KeyboardInterrupt raised inside `import jax` could crash the interpreter.
    print("\ninterrupted: stopped at once, outside the training loop (nothing more to save)",
          file=sys.stderr, flush=True)
    os._exit(INTERRUPTED_EXIT_CODE)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, _stop_at_once)
    try:
        config, values = parse_train_command(argv, about=__doc__)
        workdir = values["workdir"]
        from jaxscale.runtime import distributed  # no JAX: the guard stays fast

        try:
            spec = distributed.detect_here()
            if distributed.needs_guard(spec):
                # One of several processes: the trainer runs as this process's child, and this
                # one exits 75 when JAX aborts the child because the run lost a process.
                sys.exit(distributed.guard([sys.executable, "-m", "jaxscale.train", *argv[1:]],
                                           spec))
        except (JaxscaleError, TransientError) as e:
            fail_with(e)
        from jaxscale.observe.run_log import RunLog

        # What libraries log goes to <workdir>/train.log, not over the run's own lines, until
        # the process ends (tracebacks come while it stops, too).
        RunLog(verbose=values["verbose"])
        # Import JAX only now, so that --help, flag errors and the guard stay fast.
        import jax

        from jaxscale.checkpoint.manager import checkpoint_dir
        from jaxscale.checkpoint.signals import RunStopped
        from jaxscale.checks import runs_on
        from jaxscale.plan.auto import planned_config
        from jaxscale.runtime import agreement, arrivals, cuda_plugin, xla_flags
        from jaxscale.runtime.tpu_host import quiet_libtpu
        from jaxscale.trainer import Trainer
        from jaxscale.training import elastic

        try:
            # Before JAX starts a backend, which reads XLA_FLAGS once.
            xla_flags.apply(config.performance.xla_flags)
            # Before anything touches a device: every process of a multi-host run must join.
            began = time.perf_counter()
            # The checkpoint folder holds the arrival markers of processes that come late.
            checkpoints_at = checkpoint_dir(config, workdir)
            distributed.initialize(timeout_s=config.distributed.init_timeout_s,
                                   heartbeat_timeout_s=config.distributed.heartbeat_timeout_s,
                                   checkpoint_dir=checkpoints_at,
                                   runs_on=functools.partial(runs_on, config))
            rendezvous_seconds = time.perf_counter() - began
            agreement.exit_on_announced_failure()
            # After `initialize`, which reads TPU pods' own TPU_* variables to find its peers.
            with quiet_libtpu(), cuda_plugin.kept_out():
                # An elastic run restarted on fewer hosts keeps its global batch.
                full = distributed.max_processes(os.environ, jax.process_count())
                config, devices, note = elastic.fitted(config, jax.devices(),
                                                       full * jax.local_device_count())
                if note and jax.process_index() == 0:
                    print(f"jaxscale: {note}", flush=True)
                planned_step = None
                if config.mesh.auto:  # the planner chooses the layout and compiles its step
                    config, planned_step = planned_config(config, devices)
                # A narrower run takes its lost processes back when they return.
                with arrivals.watched(checkpoints_at, elastic=distributed.elastic(),
                                     narrower=distributed.narrower(), widens=distributed.widens):
                    Trainer(config, workdir, devices, planned_step=planned_step,
                            rendezvous_seconds=rendezvous_seconds).run()
        except (JaxscaleError, TransientError) as e:
            # At once when the others were told and exit on their own: a clean exit would wait
            # for them at JAX's shutdown barrier.
            fail_with(e, exit=agreement.leave if agreement.failure_announced() else sys.exit)
        except RunStopped as e:  # the trainer has said where it stopped
            sys.exit(e.exit_code)
        except (jax.errors.JaxRuntimeError, ValueError) as e:  # gloo's failure comes as either
            distributed.exit_if_peer_lost(e)
            raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    main(sys.argv)
