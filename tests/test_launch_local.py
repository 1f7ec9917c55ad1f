"""The local multi-process launcher, and how real processes fail: real CPU processes with gloo;
its Ctrl-C handling with real signals and stand-in processes; every launcher's --help."""

import argparse
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxscale.errors import RESTART_EXIT_CODE, TRANSIENT_EXIT_CODE
from jaxscale.launch.local import Launcher, free_port, process_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = [sys.executable, "-m", "jaxscale.launch.local"]
CHECK = [sys.executable, "-m", "jaxscale.launch.check"]
# Launcher: a dead process is noticed within 0.1 s, the others get --grace_s to stop, then
# SIGKILL. Without the launcher, JAX stops the survivors after the heartbeat timeout.
GRACE_S = 3
HEARTBEAT_S = 5
SLACK_S = 10  # process start-up and teardown on a loaded 2-core machine


def run(cmd, timeout=120):
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_two_processes_sum_across_all_eight_devices():
    result = run([*LAUNCH, "--processes=2", "--devices_per_process=4",
                  "--module=jaxscale.launch.check", "--", "--steps=2"])
    assert result.returncode == 0, result.stdout + result.stderr
    for i in (0, 1):
        assert f"[{i}] process {i} of 2" in result.stdout
        assert f"[{i}] step 1: sum over 8 devices = 12 (ok)" in result.stdout
    assert ("[0] jaxscale: distributed mode explicit: 2 processes, coordinator 127.0.0.1:"
            in result.stdout)


def _start_check_processes(steps: int):
    """Two check processes under the launcher; returns (launcher, pid of process 1)."""
    launcher = subprocess.Popen(
        [*LAUNCH, "--processes=2", "--devices_per_process=2", f"--grace_s={GRACE_S}",
         "--module=jaxscale.launch.check", "--", f"--steps={steps}", "--interval_s=0.2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = {}
    for line in launcher.stdout:
        if m := re.match(r"\[(\d)\] process \d of 2 \(pid (\d+)", line):
            pids[int(m.group(1))] = int(m.group(2))
        if line.startswith("[1] step 1:"):  # both joined and summing
            return launcher, pids[1]
    raise AssertionError(f"the processes never started: {launcher.stderr.read()}")


def test_kill_9_of_one_process_stops_the_others_within_the_grace_period():
    launcher, pid = _start_check_processes(steps=1000)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    _, stderr = launcher.communicate(timeout=GRACE_S + SLACK_S)
    assert time.monotonic() - killed_at < GRACE_S + SLACK_S
    assert launcher.returncode == TRANSIENT_EXIT_CODE  # a lost host: restart, no crash
    assert ("error: process 1 was killed by SIGKILL (a lost host); all 2 processes have stopped "
            "(transient: exit 75, retry with backoff)") in stderr


@pytest.mark.parametrize("victim", [0, 1])
def test_kill_9_without_a_launcher_ends_the_survivor_within_the_heartbeat_timeout(victim):
    port = free_port()
    procs = [subprocess.Popen(
        [*CHECK, "--steps=1000", "--interval_s=0.2", f"--heartbeat_timeout_s={HEARTBEAT_S}"],
        cwd=REPO, env=process_env(dict(os.environ), i, 2, 2, port), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    survivor = procs[1 - victim]
    for line in survivor.stdout:
        if line.startswith("step 1:"):
            break
    procs[victim].kill()
    killed_at = time.monotonic()
    output = survivor.communicate(timeout=HEARTBEAT_S + SLACK_S)[0]
    assert time.monotonic() - killed_at < HEARTBEAT_S + SLACK_S
    assert survivor.returncode != 0
    # JAX's coordination service says why: the dead peer's heartbeats stopped, or its socket closed.
    assert "Terminating process because the JAX distributed service detected fatal errors" in output
    procs[victim].wait()


def test_a_process_that_never_arrives_is_named_and_the_start_is_retried():
    env = process_env(dict(os.environ), 0, 2, 1, free_port())
    result = subprocess.run([*CHECK, "--init_timeout_s=2"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == TRANSIENT_EXIT_CODE  # a peer that never came: infrastructure
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: process 0 waited for the other 1 processes until the timeout, but process(es) "
        "[1] never arrived")


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_launcher_exits_with_restart_code_when_every_process_asks_to_restart(capsys):
    slow_restart = f"import sys, time; time.sleep(1); sys.exit({RESTART_EXIT_CODE})"
    quick_restart = f"import sys; sys.exit({RESTART_EXIT_CODE})"
    launcher = Launcher([_python(quick_restart), _python(slow_restart)], [dict(os.environ)] * 2,
                        grace_s=30)
    assert launcher.wait() == RESTART_EXIT_CODE  # process 1 got time to finish saving
    assert "waiting up to 30 s for the others" in capsys.readouterr().err


def test_launcher_stops_the_others_when_one_fails(capsys):
    start = time.monotonic()
    sleeper, failure = _python("import time; time.sleep(60)"), _python("import sys; sys.exit(3)")
    launcher = Launcher([sleeper, failure], [dict(os.environ)] * 2, grace_s=5)
    assert launcher.wait() == 3
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err
    assert "process 1 exited with status 3; stopping the others" in err
    assert "error: process 1 exited with status 3; all 2 processes have stopped" in err


def _exit_after(seconds: float, status: int) -> list[str]:
    return _python(f"import sys, time; time.sleep({seconds}); sys.exit({status})")


def test_processes_that_all_exit_75_make_the_run_75_after_waiting_for_each_other(capsys):
    launcher = Launcher([_exit_after(0, TRANSIENT_EXIT_CODE), _exit_after(1, TRANSIENT_EXIT_CODE)],
                        [dict(os.environ)] * 2, grace_s=30)
    assert launcher.wait() == TRANSIENT_EXIT_CODE  # process 1 was not stopped: it had 30 s
    err = capsys.readouterr().err
    assert err.splitlines() == ["launch.local: process 0 exited with status 75 (transient "
                                "failure, retry); waiting up to 30 s for the others"]


# Each row: (seconds before it exits, its status) per process; the launcher's status; the process
# the error line names. A later, more decisive status wins over an earlier one.
@pytest.mark.parametrize("processes, verdict, named", [
    ([(0, 75), (0.5, 1)], 1, 1),  # a crash is why the others saw a transient failure
    ([(0, 75), (0.5, 42)], 75, 0),  # transient over preempted
    ([(0, 75), (0.5, 2)], 2, 1),  # a usage error is never retried
    ([(0, 42), (0.5, -signal.SIGSEGV)], 128 + signal.SIGSEGV, 1),  # a signal is a crash
    ([(0, 42), (0.5, -signal.SIGKILL)], 75, 1),  # but SIGKILL's, a lost host: transient
])
def test_the_run_ends_with_the_most_decisive_status_of_its_processes(
        capsys, processes, verdict, named):
    commands = [_python(f"import os, signal, time; time.sleep({delay}); os.kill(os.getpid(), "
                        f"{-status})") if status < 0 else _exit_after(delay, status)
                for delay, status in processes]
    launcher = Launcher(commands, [dict(os.environ)] * 2, grace_s=30)
    assert launcher.wait() == verdict
    assert f"error: process {named} " in capsys.readouterr().err


def test_a_process_the_launcher_killed_has_no_say_in_the_verdict(capsys):
    # Process 1 never reaches the others' verdict: killed after the grace period, its SIGKILL
    # is the launcher's doing, not a crash of the run.
    launcher = Launcher([_exit_after(0, TRANSIENT_EXIT_CODE), _exit_after(60, 0)],
                        [dict(os.environ)] * 2, grace_s=0.5)
    assert launcher.wait() == TRANSIENT_EXIT_CODE
    assert "processes still running after 0.5 s; killing them" in capsys.readouterr().err


GLOO_LINE = ("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks "
             "is : 3")


@pytest.mark.parametrize("verbose", [False, True])
def test_gloo_connection_lines_are_hidden_unless_verbose(capsys, verbose):
    launcher = Launcher([_python(f"print({GLOO_LINE!r}); print('step 1')")], [dict(os.environ)],
                        grace_s=5, verbose=verbose)
    assert launcher.wait() == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ([f"[0] {GLOO_LINE}"] if verbose else []) + ["[0] step 1"]


def test_launcher_prefixes_each_line_with_its_process(capsys):
    launcher = Launcher([_python("print('a'); print('b')"), _python("print('c')")],
                        [dict(os.environ)] * 2, grace_s=5)
    assert launcher.wait() == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["[0] a", "[0] b", "[1] c"]


def test_each_process_gets_its_own_device_count_and_identity():
    env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1"},
                      1, 2, 4, 5000)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=4"]
    assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == (
        "127.0.0.1:5000", "2", "1")
    assert env["JAXSCALE_HOST_SLOT"] == "1"  # its own id, unless a restart renumbered it
    assert process_env({}, 2, 3, 1, 5000, 4, slot=3)["JAXSCALE_HOST_SLOT"] == "3"


# Stands in for jaxscale.train under Ctrl-C, without JAX: argv[1] says what it does on SIGINT
# ("exit": exit 130, as training does once it has saved; "keep_saving": go on, a long save); it logs
# each SIGINT to argv[2]/signals.<process id> and prints "ready PID" once its handler is in place.
STAND_IN = """
import os, signal, sys, time
on_sigint, log_dir = sys.argv[1], sys.argv[2]
me = os.environ["JAX_PROCESS_ID"]

def on_signal(signum, frame):
    with open(os.path.join(log_dir, "signals." + me), "a") as f:
        f.write("SIGINT\\n")
    print("got INT", flush=True)
    if on_sigint == "exit":
        sys.exit(130)

signal.signal(signal.SIGINT, on_signal)
print("ready", os.getpid(), flush=True)
for _ in range(600):
    time.sleep(0.1)
sys.exit(1)
"""


@pytest.fixture
def start_stand_ins(tmp_path):
    """Starts launch.local over two stand-in processes, in a session of its own as a terminal
    would; returns (launcher, their pids) once both are ready. A test that goes wrong fails
    instead of hanging: everything is killed after 60 s."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    pids, watchdogs = [], []

    def start(on_sigint):
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
        launcher = subprocess.Popen(
            [*LAUNCH, "--processes=2", "--module=stand_in", "--", on_sigint, str(tmp_path)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        watchdogs.append(threading.Timer(60, kill, [launcher.pid]))
        watchdogs[-1].start()
        for line in launcher.stdout:
            if m := re.match(r"\[\d\] ready (\d+)", line):
                pids.append(int(m.group(1)))
                if len(pids) == 2:
                    return launcher, list(pids)
        raise AssertionError(f"the stand-ins never started: {launcher.stderr.read()}")

    yield start
    for watchdog in watchdogs:
        watchdog.cancel()
    for pid in pids:
        kill(pid)  # a stand-in a broken launcher left behind


def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def signals_received(tmp_path):
    return {i: (tmp_path / f"signals.{i}").read_text().split()
            if (tmp_path / f"signals.{i}").exists() else [] for i in (0, 1)}


def ctrl_c(process):
    """What a terminal does on Ctrl-C: SIGINT to the foreground process group."""
    os.killpg(process.pid, signal.SIGINT)


def test_ctrl_c_reaches_every_process_once_and_the_launcher_exits_130(tmp_path, start_stand_ins):
    launcher, _ = start_stand_ins("exit")
    ctrl_c(launcher)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 130
    assert signals_received(tmp_path) == {0: ["SIGINT"], 1: ["SIGINT"]}
    assert err.splitlines() == ["launch.local: interrupted (Ctrl-C); all 2 processes have "
                                "stopped; run the same command again to resume"]


def test_a_second_ctrl_c_kills_every_process_at_once(tmp_path, start_stand_ins):
    launcher, pids = start_stand_ins("keep_saving")
    ctrl_c(launcher)
    saving = set()
    for line in launcher.stdout:  # both are saving
        if line.endswith("got INT\n"):
            saving.add(line[:3])
            if len(saving) == 2:
                break
    ctrl_c(launcher)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 130
    assert signals_received(tmp_path) == {0: ["SIGINT"], 1: ["SIGINT"]}  # then SIGKILL
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert err.splitlines() == ["launch.local: second Ctrl-C: killed all 2 processes at once, "
                                "without saving; run the same command again to resume from the "
                                "last checkpoint"]


LAUNCHERS = ["jaxscale.launch.local", "jaxscale.launch.check", "jaxscale.launch.fit",
             "jaxscale.launch.gke", "jaxscale.launch.supervise"]


@pytest.mark.parametrize("module", LAUNCHERS)
def test_help_gives_every_flag_a_sentence(module):
    result = run([sys.executable, "-m", module, "--help"], timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    shown = " ".join(result.stdout.split())
    for action in importlib.import_module(module).make_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help and action.help[0].isupper() and action.help.endswith("."), name
        assert f"{name} " in shown, name
        assert " ".join(action.help.split()[:3]) in shown, name
