"""Several jaxscale processes on one machine, each with its own simulated CPU devices:

    python -m jaxscale.launch.local --processes=2 --devices_per_process=4 -- \\
        --config=configs/tiny.py --workdir=runs/local

Everything after `--` goes to `python -m jaxscale.train` (or `--module`); a training flag given
without the `--` is an error that says so. The processes find each other through
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (runtime.distributed's explicit mode)
and use gloo for cross-process collectives. Each output line is prefixed with its process id;
gloo's `[Gloo] Rank N is connected to M peer ranks` lines are hidden unless `--verbose`.

If a process crashes or exits 2, the others are stopped (SIGTERM, then SIGKILL after --grace_s).
A process that exits 42 (preempted) or 75 (transient failure) reports a verdict every process
reaches: the others get --grace_s to reach it too before they are killed.

A process killed by SIGKILL is a lost host (a VM gone, a node drained, `kill -9`): the SIGTERM
the others then get wakes a collective blocked on the lost peer (gloo notices the closed socket
only then), which fails, and they exit 75 at once (jaxscale.train).

The launcher's exit status is the run's verdict, read from the processes that ended on their own
(not those it stopped): the most decisive status any of them gave, in this order: 2 (a usage error:
nothing may retry it), a crash (any other status or a signal but SIGKILL: it uses up a crash
budget), 130 (interrupted), 75 (transient; a process killed by SIGKILL counts as one), 42
(preempted), 0; among equals, the first to end. So a process
that crashed while the others exited 75 because their peer was gone makes the run a crash, as the
crashed pod does on GKE: the 75s are what the survivors saw, the crash is why, and a crash that
repeats must use up `jaxscale.supervise`'s --max_restarts rather than be retried forever.

Elastic (a host range): with `--min_processes=M` (below --processes, the range's maximum), a lost
process (killed by SIGKILL) does not end the run while at least M remain: the launcher kills the
others at once (they can neither save nor go on without their peer: JAX's process count is fixed in
a live process) and starts the run again on the survivors' count, ids 0..n-1, from the last
checkpoint (not a crash; the trainer keeps the global batch, jaxscale/training/elastic.py); below M
it exits 75 naming who is missing. With `--return_after_s=S` a lost slot comes back S seconds after
the loss, once the narrower run's processes have met: the launcher starts it again as a late process
(output prefixed `[returning SLOT]`), which goes the way a late GKE pod goes (runtime/arrivals.py):
it finds the run started without it, writes its arrival marker in the checkpoint folder and waits;
the narrower run's process 0 sees the marker, every process saves one agreed step and exits 42, and
the launcher then stops the waiting process and starts the run again on the full count, a planned
restart. The processes learn the range's maximum from JAXSCALE_MAX_PROCESSES, its minimum from
JAXSCALE_MIN_PROCESSES, and each its slot from JAXSCALE_HOST_SLOT: its id at the first start, kept
when the survivors are renumbered, so that it finds its own local checkpoints. A count of survivors
on which the run would leave one process's devices all idle (JAXSCALE_DEVICES_PER_PROCESS tells
the processes how many each has) starts on the largest count below it that runs; the others are
spares (`is a spare` in their output), which wait as late processes do and are no part of the
run's verdict, until enough return for a count that runs.

Signals: the processes run in sessions of their own, so a Ctrl-C in the terminal reaches the
launcher only. The first SIGTERM or SIGINT it gets is passed on to every process, once (a SIGTERM:
they save and exit 42; a Ctrl-C: they finish the step in flight, save and exit 130). When they have
all exited 130 the launcher prints one line saying so and how to resume (run the same command
again) and exits 130. A second Ctrl-C kills every process at once (SIGKILL; nothing saved since the
last checkpoint) and exits 130. A Ctrl-C while the config is being checked starts nothing (exit
130; SIGTERM: 42). None of these prints a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxscale.cli import ArgumentParser
from jaxscale.errors import (
    INTERRUPTED_EXIT_CODE,
    RESTART_EXIT_CODE,
    TRANSIENT_EXIT_CODE,
    USAGE_EXIT_CODE,
    describe_exit,
    interrupted,
    is_crash,
    shell_exit_status,
)
from jaxscale.launch.cli import (
    StopRequest,
    check_train_args,
    nonnegative,
    nonnegative_float,
    parse_launcher_args,
    positive,
)
from jaxscale.runtime.distributed import (
    DEVICES_PER_PROCESS_VAR,
    HOST_SLOT_VAR,
    MAX_PROCESSES_VAR,
    MIN_PROCESSES_VAR,
)

POLL_S = 0.1


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m jaxscale.launch.local",
        description="Run N jaxscale processes on this machine; the arguments after -- go to the "
                    "module (default jaxscale.train).",
        epilog="example: python -m jaxscale.launch.local --processes=2 -- "
               "--config=configs/tiny.py --workdir=runs/local")
    parser.add_argument("--processes", type=positive, default=2,
                        help="Number of processes to start (default 2).")
    parser.add_argument("--min_processes", type=positive, default=None,
                        help="Elastic: the fewest processes the run goes on with after losing "
                             "some (default: --processes, not elastic).")
    parser.add_argument("--return_after_s", type=nonnegative_float, default=None,
                        help="Elastic: seconds after a loss when the lost processes come back "
                             "and the run restarts on the full count (default: never).")
    parser.add_argument("--devices_per_process", type=positive, default=4,
                        help="Simulated CPU devices in each process (default 4).")
    parser.add_argument("--module", default="jaxscale.train",
                        help="Python module each process runs as python -m MODULE ARGS "
                             "(default jaxscale.train).")
    parser.add_argument("--grace_s", type=nonnegative_float, default=10.0,
                        help="Seconds the other processes get to exit, after one has stopped, "
                             "before they are killed (default 10).")
    parser.add_argument("--port", type=port_number, default=0,
                        help="Coordinator port (default 0: pick a free one).")
    parser.add_argument("--verbose", action="store_true",
                        help="Also show the processes' gloo connection messages "
                             "([Gloo] Rank ...), hidden by default.")
    return parser


def port_number(text: str) -> int:
    """argparse type: 0 (pick one) or a port."""
    port = nonnegative(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{port} is too large; pass a port <= 65535, or 0 to "
                                         "pick a free one")
    return port


def parse_args(argv: list[str]):
    """The launcher's flags, and the arguments after `--` for the module."""
    return parse_launcher_args(make_parser(), argv, "jaxscale.train (or --module)")


def free_port() -> int:
    """A port that is free on 127.0.0.1 right now (the coordinator's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: dict[str, str], process_id: int, num_processes: int, devices: int,
                port: int, max_processes: int | None = None, slot: int | None = None,
                min_processes: int | None = None) -> dict[str, str]:
    """The environment of process `process_id`: its simulated devices and its identity in the run
    (jaxscale.runtime.distributed's explicit mode); `max_processes` and `min_processes`: an
    elastic range's; `slot`: the id it had at the first start (its local checkpoints' folder),
    `process_id` when None."""
    # Replace, not add to, any device count the caller set (tests run under 8 simulated devices).
    xla_flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                       base.get("XLA_FLAGS", ""))
    return {
        **base,
        "XLA_FLAGS": f"{xla_flags} --xla_force_host_platform_device_count={devices}".strip(),
        "JAX_PLATFORMS": "cpu",
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": str(num_processes),
        "JAX_PROCESS_ID": str(process_id),
        "PYTHONUNBUFFERED": "1",  # lines reach the prefixer as they are written
        MAX_PROCESSES_VAR: str(max_processes or num_processes),
        HOST_SLOT_VAR: str(process_id if slot is None else slot),
        DEVICES_PER_PROCESS_VAR: str(devices),
        **({MIN_PROCESSES_VAR: str(min_processes)} if min_processes is not None else {}),
    }


def verdict(status: int) -> int:
    """A process's status as the run's verdict: a process killed by SIGKILL is a lost host, a
    transient failure (75); the others, as they are."""
    return TRANSIENT_EXIT_CODE if status == -signal.SIGKILL else status


def decisiveness(status: int) -> int:
    """How much a process's status says about the run: the verdict is the most decisive one (the
    module docstring gives the order and why)."""
    status = verdict(status)
    if status == USAGE_EXIT_CODE:
        return 5
    if is_crash(status):
        return 4
    if interrupted(status):
        return 3
    return {TRANSIENT_EXIT_CODE: 2, RESTART_EXIT_CODE: 1}.get(status, 0)


# The gloo lines every process prints once its collectives are connected; shown with --verbose.
GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
# Process 0's line once JAX has started (runtime/distributed.py): the rendezvous is over, so a
# late process finds JAX's service, never a rendezvous of the narrower count (which would refuse
# its count and stop the run), and a stop asked from now on is a planned one.
JOINED_LINE = re.compile(rb"jaxscale: distributed mode ")
# A process the rendezvous left out (runtime/rendezvous.py's spares): from then on it waits as a
# late process does, no part of the run or its verdict.
SPARE_LINE = re.compile(rb"jaxscale: elastic: process \d+ of \d+ is a spare")


class Launcher:
    """Starts one process per command, prefixes their output, and stops them all together.

    `on_signal` is the launcher's SIGTERM and SIGINT handler: the first of either is passed on to
    every process once; a later SIGINT (a second Ctrl-C) kills them all at once."""

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]], grace_s: float,
                 *, verbose: bool = False, widen_at: float = float("inf"),
                 returning: dict[int, tuple[list[str], dict[str, str]]] | None = None,
                 min_processes: int | None = None):
        """`widen_at`: when (time.monotonic()) to start the `returning` processes (by slot: the
        command and environment of each), once its processes have met: late processes that announce
        themselves, and the run stops (42) for a planned restart on more processes;
        `min_processes`: the run goes on after a loss with at least this many (main() restarts
        it; a loss is then no error)."""
        self.grace_s = grace_s
        self.min_processes = min_processes or len(commands)
        self.widen_at, self.returning = widen_at, returning or {}
        self.widened = False  # the returning processes were started
        self.late: list[subprocess.Popen] = []  # they are no part of this run: never a verdict
        self.spares: set[int] = set()  # the processes the rendezvous left out: neither
        self.joined = threading.Event()  # the processes have met
        self.verbose = verbose
        self.output_lock = threading.Lock()
        self.stop = StopRequest()
        self.procs: list[subprocess.Popen] = []
        self.delivered: list[set[int]] = []  # signals already sent to each process
        self.ended: list[int] = []  # the processes that have exited, in the order seen
        self.stopped: set[int] = set()  # the processes the launcher signalled on its own
        self.pumps: list[threading.Thread] = []
        for cmd, env in zip(commands, envs):
            self.delivered.append(set())
            self.procs.append(self._start(cmd, env, str(len(self.procs)), len(self.procs)))
            self._deliver()  # a signal that came while the processes were starting

    def _start(self, cmd: list[str], env: dict[str, str], label: str,
               index: int | None = None) -> subprocess.Popen:
        """Starts one process, its output prefixed with `[label]`; `index`: its place in the
        run's processes (None: a late one)."""
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        pump = threading.Thread(target=self._pump, args=(label, proc.stdout, index), daemon=True)
        pump.start()
        self.pumps.append(pump)
        return proc

    def _pump(self, label: str, stream, index: int | None) -> None:
        for line in iter(stream.readline, b""):
            if not self.verbose and GLOO_CONNECTED.match(line):
                continue
            if JOINED_LINE.match(line):
                self.joined.set()
            if index is not None and SPARE_LINE.match(line):
                self.spares.add(index)
            with self.output_lock:
                sys.stdout.write(f"[{label}] {line.decode(errors='replace')}")
                sys.stdout.flush()

    def say(self, message: str) -> None:
        with self.output_lock:
            print(f"launch.local: {message}", file=sys.stderr, flush=True)

    def on_signal(self, signum, frame) -> None:
        """Runs on the main thread wherever it is: it only records and sends signals (no output,
        no locks), and wait() reports."""
        self.stop.record(signum)
        self._deliver()

    def _deliver(self) -> None:
        """Sends each process what it has not been sent yet: the stop signal, then SIGKILL."""
        for i, p in enumerate(self.procs):
            for signum in self.stop.undelivered(self.delivered[i]):
                self._send(p, signum)

    @staticmethod
    def _send(p: subprocess.Popen, signum: int) -> None:
        if p.returncode is None:
            try:
                # Each process leads its own session (start_new_session): its group is its pid.
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass  # it exited since; wait() collects its status

    def stop_the_others(self, signum: int) -> None:
        """Sends `signum` to every process still running; what they then exit with is the
        launcher's doing, not a verdict of theirs."""
        for i, p in enumerate(self.procs):
            if p.returncode is None:
                self.stopped.add(i)
                self._send(p, signum)

    def members(self) -> list[int]:
        """The processes the run started with: all but its spares."""
        return [i for i in range(len(self.procs)) if i not in self.spares]

    def running(self) -> bool:
        statuses = [p.poll() for p in self.procs]  # poll each one; any() would stop at the first
        self.ended += [i for i, s in enumerate(statuses) if s is not None and i not in self.ended]
        return any(statuses[i] is None for i in self.members())

    def lost(self) -> list[int]:
        """The processes killed by SIGKILL not by the launcher: lost hosts."""
        return [i for i in self.members()
                if self.procs[i].returncode == -signal.SIGKILL and i not in self.stopped]

    def _expected(self, code: int) -> bool:
        """Whether a process ending with `code` is doing what it was asked: finishing, or stopping
        for a Ctrl-C the launcher passed on."""
        return code == 0 or (self.stop.signal == signal.SIGINT and interrupted(code))

    def first_failure(self) -> tuple[int, int] | None:
        """(process id, status) of the first process that failed, if any has."""
        return next(((i, self.procs[i].returncode) for i in self.members()
                     if self.procs[i].returncode is not None
                     and not self._expected(self.procs[i].returncode)), None)

    def wait(self) -> int:
        """Supervises until every process has exited; returns the launcher's exit status."""
        failure, kill_at = None, float("inf")
        while self.running():
            if failure is None and (failure := self.first_failure()) is not None:
                i, code = failure
                kill_at = time.monotonic() + self.grace_s
                if code in (RESTART_EXIT_CODE, TRANSIENT_EXIT_CODE):
                    # A verdict every process reaches (a coordinated preemption saving the same
                    # step; a failure they all saw): the others get the grace period to reach it.
                    self.say(f"process {i} {describe_exit(code)}; waiting up to "
                             f"{self.grace_s:g} s for the others")
                elif code == -signal.SIGKILL and self.min_processes < len(self.procs):
                    # Elastic: the run goes on without it, from the last checkpoint; the others
                    # can neither save (every save needs the lost peer) nor go on in this JAX.
                    self.say(f"process {i} {describe_exit(code)}; stopping the others at once "
                             "to go on without it")
                    self.stop_the_others(signal.SIGKILL)
                else:
                    self.say(f"process {i} {describe_exit(code)}; stopping the others")
                    self.stop_the_others(signal.SIGTERM)
            elif kill_at == float("inf") and any(
                    p.returncode is not None and interrupted(p.returncode) for p in self.procs):
                # After a Ctrl-C the processes stop at the same step; one has: the others get the
                # grace period to follow.
                kill_at = time.monotonic() + self.grace_s
            elif (not self.widened and self.joined.is_set()
                  and time.monotonic() > self.widen_at and self.stop.signal is None):
                # The lost processes are back, late: they announce themselves, the run saves and
                # exits 42 (its own verdict), and main() starts it wider.
                self.widened = True
                self.say(f"slot(s) {sorted(self.returning)} back: starting them as late "
                         "processes")
                self.late = [self._start(cmd, env, f"returning {slot}")
                             for slot, (cmd, env) in sorted(self.returning.items())]
            elif time.monotonic() > kill_at and not self.stop.killed:
                self.say(f"processes still running after {self.grace_s:g} s; killing them")
                self.stop_the_others(signal.SIGKILL)
                kill_at = float("nan")  # never again (nan compares false)
            time.sleep(POLL_S)
        # Waiting to be taken back, which the next start does.
        for p in [*self.late, *(self.procs[i] for i in self.spares)]:
            self._send(p, signal.SIGKILL)
            p.wait()
        for t in self.pumps:
            t.join()
        codes = [p.returncode for p in self.procs]
        if self.stop.killed:
            self.say(f"second Ctrl-C: killed all {len(codes)} processes at once, without saving; "
                     "run the same command again to resume from the last checkpoint")
            return INTERRUPTED_EXIT_CODE
        # Never empty: the launcher stops processes only after one has ended on its own.
        own = [i for i in self.ended if i not in self.stopped and i not in self.spares]
        i = max(own, key=lambda i: decisiveness(codes[i]))  # the first of the most decisive
        code = verdict(codes[i])
        if code == 0:
            return 0
        if self._expected(code):
            self.say(f"interrupted (Ctrl-C); all {len(codes)} processes have stopped; run the "
                     "same command again to resume")
            return INTERRUPTED_EXIT_CODE
        if code in (RESTART_EXIT_CODE, TRANSIENT_EXIT_CODE) and all(
                verdict(codes[j]) == code for j in own):
            if codes[i] == -signal.SIGKILL and len(codes) - len(self.lost()) < self.min_processes:
                # The survivors said what they saw; this is why.
                print(f"error: process {i} was killed by SIGKILL (a lost host); all {len(codes)} "
                      f"processes have stopped (transient: exit {code}, retry with backoff)",
                      file=sys.stderr)
            return code  # the verdict they all reached; each process has said why
        print(f"error: process {i} {describe_exit(code)}; all {len(codes)} processes have "
              "stopped", file=sys.stderr)
        return shell_exit_status(code)


def main(argv: list[str]) -> int:
    pending: list[int] = []  # signals that came before the processes were started
    launcher: Launcher | None = None

    def on_signal(signum, frame):
        if launcher is not None:
            launcher.on_signal(signum, frame)
        elif signum == signal.SIGINT and signal.SIGINT in pending:
            # A second Ctrl-C while the config is checked: nothing has started, stop at once.
            os.write(2, b"launch.local: interrupted before any process started\n")
            os._exit(INTERRUPTED_EXIT_CODE)
        else:
            pending.append(signum)

    # Before anything slow (the config check imports JAX): a Ctrl-C never raises
    # KeyboardInterrupt in here, which JAX's or importlib's callbacks could swallow.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    args, module_args = parse_args(argv)
    minimum = args.min_processes or args.processes
    if minimum > args.processes:
        print(f"error: --min_processes={minimum} is above --processes={args.processes}; pass a "
              "minimum no larger than the process count", file=sys.stderr)
        return USAGE_EXIT_CODE
    if args.module == "jaxscale.train":
        check_train_args(module_args, args.processes * args.devices_per_process, args.processes,
                         # The processes know their devices: a count below that is a spare's.
                         fewer_devices=(minimum * args.devices_per_process,)
                         if minimum < args.processes else ())
    if pending:  # told to stop before anything started: start nothing
        name = signal.Signals(pending[0]).name
        print(f"launch.local: got {name} before any process started; not starting them; run the "
              "same command again to start", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE if signal.SIGINT in pending else RESTART_EXIT_CODE
    # The slots of the processes that run, by id: survivors keep theirs when renumbered.
    slots, widen_at = list(range(args.processes)), float("inf")
    while True:  # one pass per start of the run: more than one only for an elastic range
        port, count = args.port or free_port(), len(slots)
        command = [sys.executable, "-m", args.module, *module_args]
        in_range = minimum if minimum < args.processes else None
        envs = [process_env(dict(os.environ), i, count, args.devices_per_process, port,
                            args.processes, slot, in_range) for i, slot in enumerate(slots)]
        # A lost slot comes back as a late process of the full count, with its first id.
        returning = {slot: (command, process_env(dict(os.environ), slot, args.processes,
                                                 args.devices_per_process, port, args.processes,
                                                 slot, in_range))
                     for slot in range(args.processes) if slot not in slots}
        launcher = Launcher([command] * count, envs, args.grace_s, verbose=args.verbose,
                            widen_at=widen_at, returning=returning, min_processes=minimum)
        for signum in pending:  # came while the processes were starting
            launcher.on_signal(signum, None)
        pending = []
        code = launcher.wait()
        if launcher.stop.signal is not None:  # the user's stop ends the run, elastic or not
            return code
        if launcher.widened and code == RESTART_EXIT_CODE:
            launcher.say(f"taking back the lost process(es): restarting on {args.processes}")
            slots, widen_at = list(range(args.processes)), float("inf")
            continue
        lost = launcher.lost()
        if code != TRANSIENT_EXIT_CODE or not lost or minimum == args.processes:
            return code
        if count - len(lost) < minimum:
            print(f"error: process(es) {lost} of {count} lost and {count - len(lost)} left, "
                  f"below --min_processes={minimum}; exit 75: start the run again once the "
                  "hosts are back", file=sys.stderr)
            return code
        launcher.say(f"process(es) {lost} lost (SIGKILL); going on with {count - len(lost)} "
                     f"of {args.processes} processes")
        slots = [slot for i, slot in enumerate(slots) if i not in lost]
        if args.return_after_s is not None:
            widen_at = time.monotonic() + args.return_after_s


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # a Ctrl-C before main() installed its handler
        print("launch.local: interrupted before any process started", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT_CODE)
