"""Faults at the launchers: what `jaxscale.supervise`, the GKE JobSet and the Slurm script do with
each exit status a run can end with (the table in docs/launch.md). 2: never retried; 42: restarted
at once; 75: retried after a backoff; neither 42 nor 75 uses up a crash budget; any other status
or a signal is a crash. launch.local's verdict over several processes is tested with its other
behaviour in tests/test_launch_local.py.

supervise runs real processes (a stand-in run that exits with the statuses it is given); the
JobSet's policy is read from a rendered manifest by the rules Kubernetes and JobSet apply; the
Slurm script runs for real, with stand-ins for srun, scontrol and its config check on PATH."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxscale.launch.gke import CONTAINER
from tests.test_launch_gke import GPU_ARGS, render
from tests.test_supervise import start_times, supervise

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(REPO, "deploy", "slurm", "jaxscale.sbatch")


# --- jaxscale.supervise -------------------------------------------------------------------------

def test_supervise_restarts_twelve_preemptions_without_using_up_max_restarts(tmp_path):
    code, starts, log = supervise(tmp_path, *["42"] * 12, "0", max_restarts=2)
    assert (code, starts) == (0, 13)
    assert "restarting it at once (preemption 12; not counted against --max_restarts)" in log
    assert "restart 1/2" not in log and "giving up" not in log


def test_supervise_retries_transient_failures_after_a_growing_backoff_without_a_crash_budget(
        tmp_path):
    # --max_restarts=0: a single crash would end it. The backoff doubles from 0.2 s to its cap,
    # 0.4 s (the helper's --max_backoff_seconds is twice --backoff_seconds).
    code, starts, log = supervise(tmp_path, *["75"] * 4, "0", max_restarts=0,
                                  backoff_seconds=0.2)
    assert (code, starts) == (0, 5)
    delays = [0.2, 0.4, 0.4, 0.4]
    assert log.splitlines() == [
        f"supervise: run exited with status 75 (transient failure, retry); restarting it in "
        f"{delay:g}s (transient failure {n}; not counted against --max_restarts)"
        for n, delay in enumerate(delays, 1)]
    times = start_times(tmp_path)
    for gap, delay in zip([b - a for a, b in zip(times, times[1:])], delays):
        assert gap >= delay  # the waits happened, not only their log lines


def test_supervise_counts_only_crashes_against_max_restarts(tmp_path):
    code, starts, log = supervise(tmp_path, "42", "75", "1", "42", "75", "1", "1", "0",
                                  max_restarts=2)
    assert (code, starts) == (1, 7)  # the third crash gives up; the 42s and 75s were free
    assert "run exited with status 1; restart 2/2" in log
    assert log.splitlines()[-1] == ("supervise: run exited with status 1; no restarts left "
                                    "(--max_restarts=2), giving up")


def test_supervise_never_retries_a_usage_error_even_after_preemptions_and_transient_failures(
        tmp_path):
    code, starts, _ = supervise(tmp_path, "42", "75", "2", "0", max_restarts=5)
    assert (code, starts) == (2, 3)


# --- the GKE JobSet -----------------------------------------------------------------------------

def pod_failure_rule(job: dict, exit_code: int, conditions=()) -> tuple[int | None, str]:
    """What the Job controller does with a pod that failed with `exit_code` in the jaxscale
    container and the pod `conditions` (types whose status is True): (the index of the first rule
    of the pod failure policy that matches, its action), or (None, "Count") when none does."""
    for index, rule in enumerate(job["podFailurePolicy"]["rules"]):
        if "onExitCodes" in rule:
            requirement = rule["onExitCodes"]
            if requirement.get("containerName", CONTAINER) != CONTAINER:
                continue
            if (exit_code in requirement["values"]) == (requirement["operator"] == "In"):
                return index, rule["action"]
        elif any(p["type"] in conditions and p["status"] == "True"
                 for p in rule["onPodConditions"]):
            return index, rule["action"]
    return None, "Count"


def jobset_outcome(jobset: dict, exit_code: int, conditions=()) -> tuple[int | None, str, str]:
    """The pod failure rule that matches, its action, and what becomes of the JobSet: "goes on"
    (the pod is replaced, nothing counted), or the JobSet failure policy's action for the Job's
    failure reason (RestartJobSet, its default, counts against maxRestarts)."""
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    index, action = pod_failure_rule(job, exit_code, conditions)
    if action == "Ignore":
        return index, action, "goes on"
    if action == "FailJob":
        reason = "PodFailurePolicy"
    else:  # Count: one failed pod is past a backoffLimit of 0
        assert job["backoffLimit"] == 0
        reason = "BackoffLimitExceeded"
    rules = jobset["spec"]["failurePolicy"]["rules"]
    jobset_action = next((r["action"] for r in rules
                          if reason in r.get("onJobFailureReasons", [reason])), "RestartJobSet")
    return index, action, jobset_action


@pytest.fixture(scope="module")
def jobset():
    return render(GPU_ARGS)


@pytest.mark.parametrize("exit_code, rule, action, then", [
    (2, 0, "FailJob", "FailJobSet"),  # a usage error: never restarted
    (130, 0, "FailJob", "FailJobSet"),  # interrupted: not restarted
    (42, 1, "Ignore", "goes on"),  # preempted: the pod is replaced, not counted
    (75, 1, "Ignore", "goes on"),  # transient: the pod is replaced, not counted
    (1, None, "Count", "RestartJobSet"),  # a crash: counted against maxRestarts
    (137, None, "Count", "RestartJobSet"),  # killed (OOM, kill -9): a crash
])
def test_jobset_acts_on_each_exit_status(jobset, exit_code, rule, action, then):
    assert jobset_outcome(jobset, exit_code) == (rule, action, then)
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 10


def test_jobset_does_not_count_a_pod_that_kubernetes_evicted(jobset):
    # A node drain or spot reclaim marks the pod DisruptionTarget; whatever it exited with (a
    # crash of a process killed mid-save, here) is not the run's failure.
    assert jobset_outcome(jobset, 1, conditions=("DisruptionTarget",)) == (2, "Ignore", "goes on")


def test_the_policy_reader_sees_a_changed_rule(jobset):
    # The reader above follows the manifest, not the table: move 75 into the FailJob rule and it
    # reports a failed JobSet.
    changed = json.loads(json.dumps(jobset))
    rules = changed["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    rules[0]["onExitCodes"]["values"].append(75)
    rules[1]["onExitCodes"]["values"].remove(75)
    assert jobset_outcome(changed, 75) == (0, "FailJob", "FailJobSet")


# --- the Slurm script ---------------------------------------------------------------------------

@pytest.fixture
def slurm(tmp_path):
    """Runs the sbatch script as Slurm would, with stand-ins on PATH that log their arguments:
    scontrol; srun, which runs the command it is given (the script's task wrapper) once per status
    in `tasks` with SLURM_PROCID set, and exits with the highest of their statuses as srun does
    (`tasks="hang"`: it waits instead, and exits 42 on SIGTERM); and `python`, which as a task
    exits with its status ("kill": dies of SIGKILL), and as the config check passes (`check="ok"`),
    or (`check="term"`) sends SIGTERM to the batch script and then dies of one, as a preemption
    that reaches the whole batch step does. `check="real"` runs the real config check."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    (bin_dir / "srun").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        args=("$@")
        for i in "${{!args[@]}}"; do  # the task wrapper's script, on one line of the log
          [[ ${{args[i]}} != *$'\\n'* ]] || args[i]="<wrapper>"
        done
        echo "srun ${{args[*]}}" >> {log}
        sleeper=""
        trap 'echo srun got TERM >> {log}; [[ -z $sleeper ]] || kill $sleeper; exit 42' TERM
        if [[ $TASKS == hang ]]; then sleep 60 > /dev/null 2>&1 & sleeper=$!; wait; fi
        while [[ $1 == --* ]]; do shift; done
        highest=0 procid=0
        for status in $TASKS; do
          SLURM_PROCID=$procid TASK_STATUS=$status "$@"
          task=$?
          if ((task > highest)); then highest=$task; fi
          procid=$((procid + 1))
        done
        exit $highest
        """))
    (bin_dir / "scontrol").write_text(f'#!/usr/bin/env bash\necho "scontrol $*" >> {log}\n')
    stub_dir = tmp_path / "stub_python"
    stub_dir.mkdir()
    (stub_dir / "python").write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "python $*" >> {log}
        if [[ $2 == jaxscale.train ]]; then
          [[ $TASK_STATUS != kill ]] || kill -KILL $$
          exit "$TASK_STATUS"
        fi
        if [[ $CHECK == term ]]; then
          kill -TERM "$PPID"
          kill -TERM $$
        fi
        echo "ok: the config fits (stand-in)"
        for arg; do
          if [[ $arg == --given_granules=* ]]; then echo "start: ${{arg#*=}}"; fi
        done
        """))
    for tool in (bin_dir / "srun", bin_dir / "scontrol", stub_dir / "python"):
        tool.chmod(0o755)
    python_dir = os.path.dirname(sys.executable)

    def start(tasks, *, gpus="8", check="ok", **env):
        python = python_dir if check == "real" else stub_dir
        env = {**os.environ, "PATH": f"{bin_dir}:{python}:{os.environ['PATH']}",
               "TASKS": tasks, "CHECK": check, "SLURM_JOB_ID": "99", "SLURM_JOB_NUM_NODES": "1",
               "SLURM_GPUS_ON_NODE": gpus, "SLURM_RESTART_COUNT": "0",
               "JAXSCALE_TRANSIENT_DELAY_S": "0", **env}
        return subprocess.Popen(
            [SBATCH, "--config=configs/tiny.py", "--workdir=/tmp/unused"], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def logged(tool=""):
        lines = log.read_text().splitlines() if log.exists() else []
        return [line for line in lines if line.startswith(tool)]

    return start, logged


@pytest.mark.parametrize("tasks, script_status, requeued", [
    ("0", 0, False),
    ("2", 2, False),  # a usage error: never requeued
    ("42", 0, True),  # preempted: requeued at once
    ("75", 0, True),  # transient: requeued after JAXSCALE_TRANSIENT_DELAY_S (0 here)
    ("130", 130, False),  # interrupted
    ("1", 1, False),  # a crash ends the job
    ("kill", 137, False),  # so does a process killed by a signal
    # Several processes: the most decisive status, whatever srun's highest would be.
    ("75 1", 1, False),  # a crash is why the others saw a transient failure
    ("75 2", 2, False),  # a usage error is never retried
    ("42 75", 0, True),  # transient over preempted
    ("42 kill", 137, False),
])
def test_slurm_acts_on_each_exit_status(slurm, tasks, script_status, requeued):
    start, logged = slurm
    job = start(tasks)
    out, err = job.communicate(timeout=60)
    assert job.returncode == script_status, err
    assert logged("srun") == ["srun --kill-on-bad-exit=0 --wait=450 bash -c <wrapper> "
                              "jaxscale-task python -m jaxscale.train --config=configs/tiny.py "
                              "--workdir=/tmp/unused"]
    assert len(logged("python -m jaxscale.train")) == len(tasks.split())  # the tasks ran
    assert logged("scontrol") == (["scontrol requeue 99"] if requeued else [])
    if "75" in tasks.split() and requeued:
        assert "the run failed for now (status 75" in out


def test_slurm_names_the_status_of_a_crashed_task(slurm):
    start, _ = slurm
    job = start("75 3")
    _, err = job.communicate(timeout=60)
    assert job.returncode == 1
    assert "jaxscale: task 1 crashed with status 3" in err.splitlines()


def test_slurm_requeues_a_transient_failure_after_the_delay(slurm):
    start, logged = slurm
    began = time.monotonic()
    job = start("75", JAXSCALE_TRANSIENT_DELAY_S="1")
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert time.monotonic() - began >= 1
    assert ("jaxscale: the run failed for now (status 75: storage, the coordinator or a peer); "
            "requeueing job 99 in 1 s") in out
    assert logged("scontrol") == ["scontrol requeue 99"]


def test_slurm_requeues_at_once_when_preempted_during_a_transient_failures_delay(slurm):
    start, logged = slurm
    job = start("75", JAXSCALE_TRANSIENT_DELAY_S="600")
    for line in job.stdout:
        if "requeueing job 99 in 600 s" in line:
            break
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)  # not 600 s
    assert job.returncode == 0, err
    assert logged("scontrol") == ["scontrol requeue 99"]


def test_slurm_requeues_any_number_of_preemptions(slurm):
    # Preemptions are not counted: a run chained past its time limit requeues once per limit.
    start, logged = slurm
    job = start("42", SLURM_RESTART_COUNT="500")
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert logged("scontrol") == ["scontrol requeue 99"]
    assert "attempt 501" in out


def test_slurm_passes_sigterm_on_and_requeues(slurm):
    # The SIGTERM comes as soon as srun has started: before the fix the script's trap was not
    # installed yet in 3 runs out of 5, and the script died of the signal (143).
    start, logged = slurm
    job = start("hang")
    deadline = time.monotonic() + 60
    while not logged("srun") and time.monotonic() < deadline:
        time.sleep(0.01)  # waits for the file that srun's stand-in writes when it starts
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert logged()[2:] == ["srun got TERM", "scontrol requeue 99"]  # after the check and srun
    assert "the run saved a checkpoint and asked to restart; requeueing job 99" in out


def test_slurm_sigterm_before_srun_requeues_without_starting_the_run(slurm):
    start, logged = slurm
    job = start("0", check="term")
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert [line.split()[0] for line in logged()] == ["python", "scontrol"]  # no srun
    assert logged()[-1] == "scontrol requeue 99"
    assert ("got SIGTERM before the run started, so did not start it; requeueing job 99"
            in out)


def test_slurm_checks_the_config_before_starting_anything(slurm):
    start, logged = slurm
    job = start("0", gpus="3", check="real")  # 3 devices cannot split the batch of 16
    _, err = job.communicate(timeout=120)
    assert job.returncode == 2 and err.startswith("error: ")
    assert logged() == []


def test_slurm_refuses_delays_that_are_not_whole_seconds(slurm):
    start, logged = slurm
    job = start("0", JAXSCALE_TRANSIENT_DELAY_S="soon")
    _, err = job.communicate(timeout=60)
    assert job.returncode == 2
    assert err.splitlines() == ["error: JAXSCALE_TRANSIENT_DELAY_S=soon must be a whole number "
                                "of seconds, e.g. 60"]
    assert logged() == []
    job = start("0", JAXSCALE_GRACE_S="-1")
    _, err = job.communicate(timeout=60)
    assert job.returncode == 2
    assert err.splitlines() == ["error: JAXSCALE_GRACE_S=-1 must be a whole number of seconds, "
                                "e.g. 60"]
