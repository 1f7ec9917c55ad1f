"""`python -m jaxscale.supervise -- CMD`: restarts on 42 and crashes, stops on 0 and 2, forwards
SIGTERM, gives up after --max_restarts. The supervised command here is a tiny script that exits
with the statuses it is given, one per start."""

import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Exits with the next status of argv[2:] ("kill" kills itself with SIGKILL), counting its starts in
# the file argv[1]. On SIGTERM it exits 42, as a preempted run does.
CHILD = """
import os, signal, sys, time
starts_file, statuses = sys.argv[1], sys.argv[2:]
starts = int(open(starts_file).read()) if os.path.exists(starts_file) else 0
open(starts_file, "w").write(str(starts + 1))
status = statuses[min(starts, len(statuses) - 1)]
if status == "wait_for_sigterm":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))
    open(starts_file + ".ready", "w").close()
    time.sleep(60)
if status == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(status))
"""


def command(tmp_path, *statuses, max_restarts=3):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return [sys.executable, "-m", "jaxscale.supervise", f"--max_restarts={max_restarts}",
            "--backoff_seconds=0.01", "--", sys.executable, str(script),
            str(tmp_path / "starts"), *statuses]


def supervise(tmp_path, *statuses, max_restarts=3):
    result = subprocess.run(command(tmp_path, *statuses, max_restarts=max_restarts), cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    starts = int((tmp_path / "starts").read_text())
    return result.returncode, starts, result.stderr


def test_a_run_asking_for_restarts_is_restarted_at_once_until_it_finishes(tmp_path):
    code, starts, log = supervise(tmp_path, "42", "42", "0")
    assert (code, starts) == (0, 3)
    assert "run exited with status 42 (restart me); restart 1/3 in 0s" in log
    assert "restart 2/3 in 0s" in log


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


def test_sigterm_goes_to_the_run_and_supervise_exits_with_its_status(tmp_path):
    process = subprocess.Popen(command(tmp_path, "wait_for_sigterm"), cwd=REPO,
                               stderr=subprocess.PIPE, text=True)
    while not (tmp_path / "starts.ready").exists():
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, log = process.communicate(timeout=30)
    assert process.returncode == 42
    assert int((tmp_path / "starts").read_text()) == 1
    assert "restart" not in log


def test_no_command_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "jaxscale.supervise", "--"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no command to supervise" in result.stderr
