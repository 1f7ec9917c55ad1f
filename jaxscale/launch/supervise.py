"""`python -m jaxscale.supervise [--max_restarts=N] -- python -m jaxscale.train ...`

Restarts a run on one machine until it finishes. The command's exit status decides:

    0                         finished                      exit 0
    2 (USAGE_EXIT_CODE)       a mistake to fix (config,     exit 2: a restart would fail the
                              too many bad steps)           same way
    130 (Ctrl-C)              interrupted, checkpoint saved exit 130: the user asked it to stop
    42 (RESTART_EXIT_CODE)    preempted, checkpoint saved   restart at once; not counted
    75 (TRANSIENT_EXIT_CODE)  storage, the coordinator or   restart after a backoff; not counted
                              a peer failed for now
    anything else, signals    crashed or killed             restart after a backoff, at most
                                                            --max_restarts times

Only crashes count against `--max_restarts`: a spot run survives any number of preemptions, and a
storage outage any length of time. The backoff starts at `--backoff_seconds` and doubles with each
crash or transient failure in a row, up to `--max_backoff_seconds`; a run that lived
HEALTHY_RUN_SECONDS starts the count afresh. Transient failures are retried without a bound, as
Kubernetes retries a CrashLoopBackOff: status 75 promises every checkpoint intact, so waiting costs
no progress, and no bound could tell a long outage from an endless one (GKE's podFailurePolicy
cannot bound them either, and the launchers must agree). After `--max_restarts` crashes it gives
up and exits with the run's last status. Each restart is logged on stderr.

Signals. The run has its own process group, so a Ctrl-C in the terminal reaches supervise only;
supervise passes the first SIGINT or SIGTERM it gets on to the run's process group, once, and from
then on starts nothing: it exits with the run's status (130 when a Ctrl-C made jaxscale.train
save and stop; 42 when a SIGTERM did) for the launcher above to decide. A second Ctrl-C kills the
run at once (SIGKILL, nothing saved since its last checkpoint) and exits 130; later SIGTERMs are
ignored (the run is already stopping). A signal during the wait before a restart ends supervise
at once, without restarting: 130 for a Ctrl-C, the last run's status for a SIGTERM. Running the
same command again resumes the run.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from jaxscale.cli import ArgumentParser, fail
from jaxscale.errors import (
    INTERRUPTED_EXIT_CODE,
    RESTART_EXIT_CODE,
    TRANSIENT_EXIT_CODE,
    USAGE_EXIT_CODE,
    describe_exit,
    interrupted,
    shell_exit_status,
)
from jaxscale.launch.cli import StopRequest, nonnegative, nonnegative_float

# A run that lived this long before crashing was healthy: the next crash starts a fresh backoff.
HEALTHY_RUN_SECONDS = 600.0
# The wait before a restart checks this often whether supervise was told to stop.
STOP_POLL_SECONDS = 0.05
# The backoff stops doubling here: far past any --max_backoff_seconds, and 2.0 ** n overflows a
# float past n = 1023, which an endless storage outage would reach in a few days.
MAX_DOUBLINGS = 60


def log(message: str) -> None:
    print(f"supervise: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(self, command: list[str], *, max_restarts: int, backoff_seconds: float,
                 max_backoff_seconds: float):
        self.command = command
        self.max_restarts = max_restarts
        self.backoff_seconds = backoff_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self.child: subprocess.Popen | None = None
        self.stop = StopRequest()
        self.delivered: set[int] = set()  # signals already sent to the current child

    def on_signal(self, signum, frame) -> None:
        """The SIGTERM and SIGINT handler. It only records and sends signals (no output, no
        waiting), so it is safe wherever the main thread is."""
        self.stop.record(signum)
        self._deliver()

    def _deliver(self) -> None:
        """Sends the current child what it has not been sent yet: the stop signal, then SIGKILL."""
        child = self.child
        if child is None or child.returncode is not None:
            return
        for signum in self.stop.undelivered(self.delivered):
            try:
                os.killpg(child.pid, signum)  # the child leads its own process group
            except ProcessLookupError:
                pass  # it has exited; wait() collects its status

    def _start(self) -> subprocess.Popen:
        self.delivered = set()
        # Its own process group: a Ctrl-C in the terminal reaches the run only through supervise.
        try:
            self.child = subprocess.Popen(self.command, process_group=0)
        except OSError as e:  # e.g. a misspelt program: restarting cannot fix it
            fail(f"cannot start {self.command[0]!r} ({e.strerror}); check the command after --")
        self._deliver()  # a signal that came while it was starting
        return self.child

    def _wait_before_restart(self, delay: float) -> None:
        """Sleeps `delay` seconds, or less if supervise is told to stop meanwhile."""
        deadline = time.monotonic() + delay
        while self.stop.signal is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, STOP_POLL_SECONDS))

    def run(self) -> int:
        """Runs the command until it finishes, fails for good, is stopped, or runs out of
        restarts; returns the exit status for this process."""
        crashes, transients, preemptions, failures_in_a_row, status = 0, 0, 0, 0, None
        while True:
            if self.stop.signal is not None:  # told to stop before a (re)start: nothing to save
                name = signal.Signals(self.stop.signal).name
                if status is not None:
                    log(f"got {name} while waiting to restart the run; not restarting it")
                if self.stop.signal == signal.SIGINT:
                    return INTERRUPTED_EXIT_CODE
                return 128 + self.stop.signal if status is None else shell_exit_status(status)
            began = time.monotonic()
            status = self._start().wait()
            if self.stop.killed:
                log("killed the run at once (second Ctrl-C); it saved nothing since its last "
                    "checkpoint; run the same command again to resume from that one")
                return INTERRUPTED_EXIT_CODE
            if (status in (0, USAGE_EXIT_CODE) or interrupted(status)
                    or self.stop.signal is not None):
                return shell_exit_status(status)
            if status == RESTART_EXIT_CODE:
                preemptions += 1
                log(f"run {describe_exit(status)}; restarting it at once (preemption "
                    f"{preemptions}; not counted against --max_restarts)")
                continue
            healthy = time.monotonic() - began >= HEALTHY_RUN_SECONDS
            failures_in_a_row = 1 if healthy else failures_in_a_row + 1
            delay = min(self.backoff_seconds * 2.0 ** min(failures_in_a_row - 1, MAX_DOUBLINGS),
                        self.max_backoff_seconds)
            if status == TRANSIENT_EXIT_CODE:
                transients += 1
                log(f"run {describe_exit(status)}; restarting it in {delay:g}s (transient failure "
                    f"{transients}; not counted against --max_restarts)")
            elif crashes == self.max_restarts:
                log(f"run {describe_exit(status)}; no restarts left (--max_restarts="
                    f"{self.max_restarts}), giving up")
                return shell_exit_status(status)
            else:
                crashes += 1
                log(f"run {describe_exit(status)}; restart {crashes}/{self.max_restarts} "
                    f"in {delay:g}s")
            self._wait_before_restart(delay)


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m jaxscale.supervise",
        description="Restart a jaxscale run that was preempted (status 42), failed for now "
                    "(75) or crashed; stop on success (0), a usage error (2) or Ctrl-C (130).",
        epilog="example: python -m jaxscale.supervise --max_restarts=20 -- "
               "python -m jaxscale.train --workdir=runs/a")
    parser.add_argument("--max_restarts", type=nonnegative, default=10,
                        help="Give up after this many crashes (default 10); preemptions (42) and "
                             "transient failures (75) do not count.")
    parser.add_argument("--backoff_seconds", type=nonnegative_float, default=5.0,
                        help="Wait this long before restarting after a crash or a transient "
                             "failure; the wait doubles with each one in a row (default 5).")
    parser.add_argument("--max_backoff_seconds", type=nonnegative_float, default=300.0,
                        help="Never wait longer than this between restarts (default 300); "
                             "transient failures are retried this often for as long as they "
                             "last.")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="The run's command line, after --.")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to supervise; put it after --, e.g. python -m "
                     "jaxscale.supervise -- python -m jaxscale.train --workdir=runs/a")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    supervisor = Supervisor(args.command, max_restarts=args.max_restarts,
                            backoff_seconds=args.backoff_seconds,
                            max_backoff_seconds=args.max_backoff_seconds)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, supervisor.on_signal)
    return supervisor.run()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # a Ctrl-C before the handlers were installed: nothing started yet
        sys.exit(INTERRUPTED_EXIT_CODE)
