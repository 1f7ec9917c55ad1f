"""Several jaxscale processes on one machine, each with its own simulated CPU devices:

    python -m jaxscale.launch.local --processes=2 --devices_per_process=4 -- \\
        --config=configs/tiny.py --workdir=runs/local

Everything after `--` goes to `python -m jaxscale.train` (or `--module`). The processes find each
other through JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (jaxscale.distributed's
explicit mode) and use gloo for cross-process collectives. Each output line is prefixed with its
process id. If a process fails, the others are stopped (SIGTERM, then SIGKILL after --grace_s) and
the launcher exits with that process's status; if every process exits with RESTART_EXIT_CODE (a
coordinated preemption), so does the launcher. SIGTERM or Ctrl-C to the launcher is passed on.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from jaxscale.errors import RESTART_EXIT_CODE, describe_exit, shell_exit_status
from jaxscale.launch.cli import ArgumentParser, check_train_args, positive

POLL_S = 0.1


def parse_args(argv: list[str]):
    parser = ArgumentParser(
        prog="python -m jaxscale.launch.local",
        description="Run N jaxscale processes on this machine; arguments after -- go to the "
                    "module (default jaxscale.train).")
    parser.add_argument("--processes", type=positive, default=2)
    parser.add_argument("--devices_per_process", type=positive, default=4,
                        help="simulated CPU devices in each process")
    parser.add_argument("--module", default="jaxscale.train",
                        help="Python module each process runs (python -m MODULE ARGS)")
    parser.add_argument("--grace_s", type=float, default=10.0,
                        help="seconds a process gets to exit after SIGTERM before SIGKILL")
    parser.add_argument("--port", type=int, default=0,
                        help="coordinator port (the rendezvous uses port + 1); 0 picks free ones")
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def free_port_pair() -> int:
    """A port P such that P and P + 1 (the rendezvous) are both free right now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535 and _is_free(port) and _is_free(port + 1):
            return port
    raise RuntimeError("found no two adjacent free ports on 127.0.0.1")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def process_env(base: dict[str, str], process_id: int, num_processes: int, devices: int,
                port: int) -> dict[str, str]:
    """The environment of process `process_id`: its simulated devices and its identity in the run
    (jaxscale.distributed's explicit mode)."""
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
    }


class Launcher:
    """Starts one process per command, prefixes their output, and stops them all together."""

    def __init__(self, commands: list[list[str]], envs: list[dict[str, str]], grace_s: float):
        self.grace_s = grace_s
        self.output_lock = threading.Lock()
        self.procs = [
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
            for cmd, env in zip(commands, envs)]
        self.pumps = [threading.Thread(target=self._pump, args=(i, p.stdout), daemon=True)
                      for i, p in enumerate(self.procs)]
        for t in self.pumps:
            t.start()

    def _pump(self, process_id: int, stream) -> None:
        for line in iter(stream.readline, b""):
            with self.output_lock:
                sys.stdout.write(f"[{process_id}] {line.decode(errors='replace')}")
                sys.stdout.flush()

    def say(self, message: str) -> None:
        with self.output_lock:
            print(f"launch.local: {message}", file=sys.stderr, flush=True)

    def signal_all(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    # Each process leads its own session (start_new_session): its group is its pid.
                    os.killpg(p.pid, signum)
                except ProcessLookupError:
                    pass  # it exited since poll(); wait() collects its status

    def running(self) -> bool:
        statuses = [p.poll() for p in self.procs]  # poll each one; any() would stop at the first
        return None in statuses

    def first_failure(self) -> tuple[int, int] | None:
        """(process id, status) of the first process that failed, if any has."""
        return next(((i, p.returncode) for i, p in enumerate(self.procs)
                     if p.returncode not in (None, 0)), None)

    def wait(self) -> int:
        """Supervises until every process has exited; returns the launcher's exit status."""
        failure, kill_at = None, float("inf")
        while self.running():
            if failure is None and (failure := self.first_failure()) is not None:
                i, code = failure
                kill_at = time.monotonic() + self.grace_s
                if code == RESTART_EXIT_CODE:
                    # A coordinated preemption: the others are saving the same step and exit on
                    # their own; they get the grace period to do it.
                    self.say(f"process {i} {describe_exit(code)}; waiting up to "
                             f"{self.grace_s:g} s for the others")
                else:
                    self.say(f"process {i} {describe_exit(code)}; stopping the others")
                    self.signal_all(signal.SIGTERM)
            elif time.monotonic() > kill_at:
                self.say(f"processes still running after {self.grace_s:g} s; killing them")
                self.signal_all(signal.SIGKILL)
                kill_at = float("inf")
            time.sleep(POLL_S)
        for t in self.pumps:
            t.join()
        codes = [p.returncode for p in self.procs]
        if all(c == RESTART_EXIT_CODE for c in codes):
            return RESTART_EXIT_CODE
        failure = failure or self.first_failure()  # the last process to exit may be the only one
        if failure is None:
            return 0
        i, code = failure
        print(f"error: process {i} {describe_exit(code)}; all {len(codes)} processes have "
              "stopped", file=sys.stderr)
        return shell_exit_status(code)


def main(argv: list[str]) -> int:
    args, module_args = parse_args(argv)
    if args.module == "jaxscale.train":
        check_train_args(module_args, args.processes * args.devices_per_process, args.processes)
    port = args.port or free_port_pair()
    commands = [[sys.executable, "-m", args.module, *module_args]] * args.processes
    envs = [process_env(dict(os.environ), i, args.processes, args.devices_per_process, port)
            for i in range(args.processes)]
    launcher = Launcher(commands, envs, args.grace_s)
    for signum in (signal.SIGTERM, signal.SIGINT):
        # A preemption of the launcher is a preemption of every process: pass it on.
        signal.signal(signum, lambda s, _frame: launcher.signal_all(s))
    return launcher.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
