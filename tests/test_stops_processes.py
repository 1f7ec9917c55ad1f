"""Multi-host stops end well (launch.local, 2 or 4 processes on 4 simulated CPU devices, fsdp=4):
a SIGTERM to the launcher or to one process, and a Ctrl-C, each with the local tier every step
and without it, stop every process within a bound, with the stop's status, all holding the
checkpoint of one agreed step, which a restart resumes from; a SIGTERM with one host seconds a
step slower does too (once it aborted on mismatched collectives). The trials are those of
benchmarks/stops.py, which runs them at random steps."""

import re

import pytest

from tests.fakes import fake_env
from tests.helpers import benchmark_module

pytestmark = pytest.mark.slow

stops = benchmark_module("stops")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One compilation cache for the module: the first run of each layout compiles, the others
    load."""
    return str(tmp_path_factory.mktemp("stops") / "compilation_cache")


def assert_ended_well(trial, outcome):
    assert outcome.ended_well(trial), (trial, outcome[:4], outcome.output[-3000:])
    assert "Traceback" not in outcome.output and "\nerror:" not in outcome.output


@pytest.mark.parametrize("processes, local, target", [
    (2, True, "launcher"), (2, False, "launcher"), (2, True, "process"), (2, False, "process"),
    (2, True, "ctrl-c"), (2, False, "ctrl-c"), (4, True, "launcher")])
def test_a_stop_ends_every_process_with_one_agreed_checkpoint(processes, local, target, cache,
                                                              tmp_path):
    trial = stops.Trial(processes, local, target, at_step=3)
    assert_ended_well(trial, stops.run(trial, str(tmp_path / "run"), cache))


def test_a_preempted_run_resumes_from_its_agreed_step(cache, tmp_path):
    workdir = str(tmp_path / "run")
    trial = stops.Trial(2, True, "process", at_step=3)
    outcome = stops.run(trial, workdir, cache)
    assert_ended_well(trial, outcome)
    restarted = stops.launch(trial, workdir, cache)
    assert restarted.wait(timeout=300) == 0
    with open(f"{workdir}.log") as f:
        output = f.read()
    assert re.search(rf"^\[0\] restored {workdir}_local/process_0/\w+/{outcome.stopped} in ",
                     output, re.M), output[-3000:]
    assert f"[0] done: step {stops.STEPS}" in output


def test_a_sigterm_with_one_slow_host_stops_both_at_one_step(cache, tmp_path):
    """Process 1 takes 2 s longer a step: the hosts' step counts differ when the SIGTERM comes."""
    trial = stops.Trial(2, True, "launcher", at_step=3)
    env = fake_env(tmp_path / "fakes", slow_host=(1, 2.0))
    assert_ended_well(trial, stops.run(trial, str(tmp_path / "run"), cache, env=env))
