"""`python -m jaxscale.supervise -- CMD`: restarts on 42, 75 and crashes, stops on 0, 2 and 130,
forwards SIGTERM and Ctrl-C, gives up after --max_restarts crashes. The supervised command here is
a tiny script that exits with the statuses it is given, one per start. The signal tests send real
signals to a real supervise process, in a session of its own, as a terminal's Ctrl-C would.
tests/test_faults_launch.py runs it through many preemptions and transient failures."""

import os
import signal
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Exits with the next status of argv[2:] ("kill" kills itself with SIGKILL), counting its starts in
# the file argv[1] and logging the time of each to argv[1] + ".times". The waiting statuses print
# "ready PID" once their handler is in place, and log each signal they get to argv[1] +
# ".signals":
#   wait_for_sigterm     exits 42 on SIGTERM, as a preempted run does;
#   wait_for_sigint      exits 130 on SIGINT, as jaxscale.train does after saving;
#   sigint_keeps_saving  prints "got INT" on each SIGINT and goes on (a long save).
CHILD = """
import os, signal, sys, time
starts_file, statuses = sys.argv[1], sys.argv[2:]
starts = int(open(starts_file).read()) if os.path.exists(starts_file) else 0
open(starts_file, "w").write(str(starts + 1))
with open(starts_file + ".times", "a") as f:
    f.write(f"{time.monotonic()}\\n")
status = statuses[min(starts, len(statuses) - 1)]

def on_signal(signum, exit_status):
    with open(starts_file + ".signals", "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
    print("got", signal.Signals(signum).name[3:], flush=True)
    if exit_status is not None:
        sys.exit(exit_status)

waits = {"wait_for_sigterm": (signal.SIGTERM, 42), "wait_for_sigint": (signal.SIGINT, 130),
         "sigint_keeps_saving": (signal.SIGINT, None)}
if status in waits:
    signum, exit_status = waits[status]
    signal.signal(signum, lambda *_: on_signal(signum, exit_status))
    print("ready", os.getpid(), flush=True)
    for _ in range(600):
        time.sleep(0.1)
    sys.exit(1)
if status == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(status))
"""


def command(tmp_path, *statuses, max_restarts=3, backoff_seconds=0.01):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [sys.executable, "-m", "jaxscale.supervise", f"--max_restarts={max_restarts}",
            f"--backoff_seconds={backoff_seconds}", f"--max_backoff_seconds={backoff_seconds * 2}",
            "--", sys.executable, str(script),
            str(tmp_path / "starts"), *statuses]


def supervise(tmp_path, *statuses, max_restarts=3, backoff_seconds=0.01):
    """Runs supervise over CHILD to the end: (its exit status, the child's starts, its log)."""
    result = subprocess.run(command(tmp_path, *statuses, max_restarts=max_restarts,
                                    backoff_seconds=backoff_seconds),
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    starts = int((tmp_path / "starts").read_text())
    return result.returncode, starts, result.stderr


def start_times(tmp_path) -> list[float]:
    """When each start of CHILD began (time.monotonic(), which every process on a machine
    shares)."""
    return [float(t) for t in (tmp_path / "starts.times").read_text().split()]


@pytest.fixture
def start_supervise(tmp_path):
    """Starts supervise in a session of its own (its process group is its pid), as a terminal runs
    it. A test that goes wrong fails instead of hanging: supervise is killed after 60 s."""
    watchdogs = []

    def start(*statuses, **kwargs):
        process = subprocess.Popen(command(tmp_path, *statuses, **kwargs), cwd=REPO,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        watchdogs.append(threading.Timer(60, lambda: process.poll() is None and process.kill()))
        watchdogs[-1].start()
        return process

    yield start
    for watchdog in watchdogs:
        watchdog.cancel()


def read_until(stream, prefix: str) -> str:
    """Reads lines from `stream` until one starts with `prefix`; returns that line."""
    for line in stream:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the stream ended before a line starting with {prefix!r}")


def signals_received(tmp_path) -> list[str]:
    path = tmp_path / "starts.signals"
    return path.read_text().split() if path.exists() else []


def ctrl_c(process) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
    os.killpg(process.pid, signal.SIGINT)


def test_a_run_asking_for_restarts_is_restarted_at_once_until_it_finishes(tmp_path):
    code, starts, log = supervise(tmp_path, "42", "42", "0")
    assert (code, starts) == (0, 3)
    assert log.splitlines() == [
        f"supervise: run exited with status 42 (restart me); restarting it at once (preemption "
        f"{n}; not counted against --max_restarts)" for n in (1, 2)]


def test_crashes_are_restarted_with_a_growing_backoff_until_no_restarts_are_left(tmp_path):
    code, starts, log = supervise(tmp_path, "1", max_restarts=2)
    assert (code, starts) == (1, 3)
    assert "run exited with status 1; restart 1/2 in 0.01s" in log
    assert "restart 2/2 in 0.02s" in log
    assert "no restarts left (--max_restarts=2), giving up" in log


def test_a_killed_run_is_restarted(tmp_path):
    code, starts, log = supervise(tmp_path, "kill", "0")
    assert (code, starts) == (0, 2)
    assert "run was killed by SIGKILL; restart 1/3" in log


def test_a_usage_error_is_not_restarted(tmp_path):
    code, starts, log = supervise(tmp_path, "2", "0")
    assert (code, starts) == (2, 1)
    assert log == ""


def test_sigterm_goes_to_the_run_and_supervise_exits_with_its_status(
        tmp_path, start_supervise):
    process = start_supervise("wait_for_sigterm")
    read_until(process.stdout, "ready")
    process.send_signal(signal.SIGTERM)
    _, log = process.communicate(timeout=30)
    assert process.returncode == 42
    assert int((tmp_path / "starts").read_text()) == 1
    assert signals_received(tmp_path) == ["SIGTERM"]
    assert "restart" not in log


def test_ctrl_c_goes_to_the_run_once_and_supervise_exits_130_without_restarting(
        tmp_path, start_supervise):
    process = start_supervise("wait_for_sigint", "0")
    read_until(process.stdout, "ready")
    ctrl_c(process)
    _, log = process.communicate(timeout=30)
    assert process.returncode == 130
    assert int((tmp_path / "starts").read_text()) == 1
    assert signals_received(tmp_path) == ["SIGINT"]  # the run's own group did not get it twice
    assert log == ""


def test_a_run_that_exits_130_by_itself_is_not_restarted(tmp_path):
    code, starts, log = supervise(tmp_path, "130", "0")
    assert (code, starts) == (130, 1)
    assert log == ""


def test_a_second_ctrl_c_kills_the_run_at_once(tmp_path, start_supervise):
    process = start_supervise("sigint_keeps_saving")
    child_pid = int(read_until(process.stdout, "ready").split()[1])
    try:
        ctrl_c(process)
        read_until(process.stdout, "got INT")  # the run is saving
        ctrl_c(process)
        _, log = process.communicate(timeout=30)
    finally:
        try:
            os.kill(child_pid, signal.SIGKILL)  # only if supervise left it running
        except ProcessLookupError:
            pass
    assert process.returncode == 130
    assert signals_received(tmp_path) == ["SIGINT"]  # the second one was a SIGKILL
    assert "killed the run at once (second Ctrl-C)" in log
    assert "Traceback" not in log and len(log.splitlines()) == 1, log


def test_ctrl_c_while_waiting_to_restart_ends_supervise_at_once(tmp_path, start_supervise):
    process = start_supervise("1", "0", backoff_seconds=600)
    read_until(process.stderr, "supervise: run exited with status 1; restart 1/3 in 600s")
    ctrl_c(process)
    _, log = process.communicate(timeout=30)  # not 600 s
    assert process.returncode == 130
    assert int((tmp_path / "starts").read_text()) == 1
    assert log.splitlines() == ["supervise: got SIGINT while waiting to restart the run; not "
                                "restarting it"]


@pytest.mark.parametrize("args, message", [
    (["--"], "no command to supervise; put it after --"),
    (["--max_restarts=-1", "--", "true"], "argument --max_restarts: -1 must be >= 0"),
    (["--max_restarts=x", "--", "true"], "argument --max_restarts: 'x' is not a whole number"),
    (["--backoff_seconds=soon", "--", "true"],
     "argument --backoff_seconds: 'soon' is not a number"),
    (["--bogus", "--", "true"], "unrecognized arguments: --bogus"),
])
def test_usage_errors_are_one_error_line(args, message):
    result = subprocess.run([sys.executable, "-m", "jaxscale.supervise", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert lines[0].endswith("(see python -m jaxscale.supervise --help)")
