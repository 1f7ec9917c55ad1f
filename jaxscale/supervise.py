"""`python -m jaxscale.supervise [--max_restarts=N] -- python -m jaxscale.train ...`

Restarts a run on one machine until it finishes. The command's exit status decides:

    0                       finished                       exit 0
    2 (USAGE_EXIT_CODE)     a mistake to fix (config,      exit 2: a restart would fail the
                            too many bad steps)            same way
    42 (RESTART_EXIT_CODE)  preempted, checkpoint saved    restart at once
    anything else, signals  crashed or killed              restart after a backoff that
                                                           doubles with each crash in a row

After `--max_restarts` restarts it gives up and exits with the run's last status. A SIGTERM or
SIGINT sent to supervise goes to the run (which saves and exits 42) and supervise then exits with
the run's status instead of restarting: the machine itself is going away, and the launcher above
decides. Each restart is logged on stderr.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from jaxscale.errors import RESTART_EXIT_CODE, USAGE_EXIT_CODE, describe_exit, shell_exit_status

# A run that lived this long before crashing was healthy: the next crash starts a fresh backoff.
HEALTHY_RUN_SECONDS = 600.0


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
        self.stopping = False

    def forward_signal(self, signum, frame) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        """Runs the command until it finishes, fails for good or runs out of restarts; returns
        the exit status for this process."""
        restarts, crashes_in_a_row = 0, 0
        while True:
            began = time.monotonic()
            # Its own process group: a Ctrl-C reaches the run once, through forward_signal.
            self.child = subprocess.Popen(self.command, process_group=0)
            status = self.child.wait()
            if status in (0, USAGE_EXIT_CODE) or self.stopping:
                return shell_exit_status(status)
            if restarts == self.max_restarts:
                log(f"run {describe_exit(status)}; no restarts left (--max_restarts="
                    f"{self.max_restarts}), giving up")
                return shell_exit_status(status)
            restarts += 1
            delay = 0.0
            if status != RESTART_EXIT_CODE:
                healthy = time.monotonic() - began >= HEALTHY_RUN_SECONDS
                crashes_in_a_row = 1 if healthy else crashes_in_a_row + 1
                delay = min(self.backoff_seconds * 2 ** (crashes_in_a_row - 1),
                            self.max_backoff_seconds)
            log(f"run {describe_exit(status)}; restart {restarts}/{self.max_restarts} "
                f"in {delay:g}s")
            time.sleep(delay)
            if self.stopping:  # told to stop while waiting: nothing to forward, nothing to save
                return shell_exit_status(status)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jaxscale.supervise",
        description="Restart a jaxscale run that was preempted (status 42) or crashed.",
        epilog="example: python -m jaxscale.supervise --max_restarts=20 -- "
               "python -m jaxscale.train --workdir=runs/a")
    parser.add_argument("--max_restarts", type=int, default=10,
                        help="give up after this many restarts (default 10)")
    parser.add_argument("--backoff_seconds", type=float, default=5.0,
                        help="wait before restarting after a crash; doubles with each crash in a "
                             "row (default 5)")
    parser.add_argument("--max_backoff_seconds", type=float, default=300.0,
                        help="longest wait between restarts (default 300)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the run's command line, after --")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to supervise; put it after --, e.g. -- python -m jaxscale.train")
    if args.max_restarts < 0 or args.backoff_seconds < 0 or args.max_backoff_seconds < 0:
        parser.error("--max_restarts, --backoff_seconds and --max_backoff_seconds must be >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    supervisor = Supervisor(args.command, max_restarts=args.max_restarts,
                            backoff_seconds=args.backoff_seconds,
                            max_backoff_seconds=args.max_backoff_seconds)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, supervisor.forward_signal)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
