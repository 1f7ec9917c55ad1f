"""Stopping on signals: Ctrl-C saves and exits 130, SIGTERM stops within a few steps whatever
`train.log_every` is, and neither ends a notebook's interpreter."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from jaxscale.checkpoint.signals import Interrupted, Preempted, RunStopped
from jaxscale.trainer import StepsInFlight, Trainer
from tests.helpers import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.model.d_model=64", "--config.model.n_layers=2", "--config.model.n_heads=4",
         "--config.model.n_kv_heads=2", "--config.model.head_dim=16", "--config.model.mlp_dim=128",
         "--config.train.batch_size=8", "--config.train.seq_len=32",
         "--config.train.eval_every=0", "--config.checkpoint.compilation_cache=False"]


def start_training(workdir, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [sys.executable, "-m", "jaxscale.train", f"--workdir={workdir}", *SMALL, *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(path, process, timeout=240):
    deadline = time.monotonic() + timeout
    while not os.path.isdir(path):
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.mark.slow
def test_ctrl_c_saves_says_how_to_resume_and_the_same_command_resumes(tmp_path):
    workdir = tmp_path / "run"
    args = ["--config.train.steps=1000", "--config.train.log_every=1000",
            "--config.checkpoint.every_steps=3"]
    process = start_training(workdir, *args)
    wait_for(workdir / "checkpoints" / "3", process)
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    stopped = re.search(r"interrupted at step (\d+): checkpoint (\S+) saved; run the same "
                        r"command again to resume", output)
    assert stopped, output[-3000:]
    step = int(stopped.group(1))
    assert os.path.isdir(stopped.group(2)) and stopped.group(2).endswith(f"/{step}")

    resumed = start_training(workdir, *args[1:], f"--config.train.steps={step + 2}")
    output = resumed.communicate(timeout=240)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert f"restored {workdir / 'checkpoints' / str(step)}" in output
    assert f"done: step {step + 2}, 2 steps" in output


@pytest.mark.slow
def test_sigterm_stops_within_a_few_steps_however_rarely_the_run_logs(tmp_path):
    workdir = tmp_path / "run"
    process = start_training(workdir, "--config.train.steps=1000",
                             "--config.train.log_every=1000", "--config.checkpoint.every_steps=5")
    wait_for(workdir / "checkpoints" / "10", process)  # the devices have finished step 10
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 42, output[-3000:]
    step = int(re.search(r"preempted at step (\d+): checkpoint \S+ saved", output).group(1))
    # The host stays at most 2 steps ahead of the devices, and the checkpoint appears a moment
    # after its step: the stop comes a few steps after 10, not at the next logging step (1000).
    assert 10 < step <= 16, output[-3000:]


def test_a_preempted_run_raises_an_ordinary_exception_in_python(tmp_path):
    config = small_config(data=8)
    config.train.steps = 10
    config.checkpoint.compilation_cache = False
    trainer = Trainer(config, str(tmp_path))
    compile_step, calls = trainer.compile_train_step, []

    def compile_step_then_sigterm(capacity=None):
        step_fn, memory = compile_step(capacity)

        def step_then_sigterm(state, batch):
            calls.append(1)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler takes it
            return step_fn(state, batch)
        return step_then_sigterm, memory

    trainer.compile_train_step = compile_step_then_sigterm
    with pytest.raises(Preempted) as stopped:
        trainer.run()
    assert stopped.value.step == 2 and stopped.value.exit_code == 42
    assert not isinstance(stopped.value, SystemExit)  # a notebook's interpreter survives it
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back


def test_stop_exceptions_carry_the_cli_exit_statuses():
    assert issubclass(Preempted, RunStopped) and issubclass(Interrupted, RunStopped)
    assert (Preempted.exit_code, Interrupted.exit_code) == (42, 130)


class Marker:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def block_until_ready(self):
        self.log.append(self.name)


def test_steps_in_flight_waits_for_all_but_the_newest_two():
    waited = []
    in_flight = StepsInFlight(limit=2)
    for step in range(1, 6):
        in_flight.add(Marker(waited, step))
        assert waited == list(range(1, step - 1)), step  # steps step-1 and step may still run


def test_only_a_second_ctrl_c_kills_a_launchers_children():
    from jaxscale.launch.cli import StopRequest

    ctrl_c_twice = StopRequest()
    ctrl_c_twice.record(signal.SIGINT)
    assert ctrl_c_twice.undelivered(set()) == [signal.SIGINT]
    ctrl_c_twice.record(signal.SIGINT)
    assert ctrl_c_twice.killed

    saving_for_a_restart = StopRequest()  # a SIGTERM's save must not be cut short by a Ctrl-C
    saving_for_a_restart.record(signal.SIGTERM)
    saving_for_a_restart.record(signal.SIGINT)
    assert not saving_for_a_restart.killed
    assert saving_for_a_restart.undelivered({signal.SIGTERM}) == []
