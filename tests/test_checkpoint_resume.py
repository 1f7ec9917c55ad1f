"""Real runs, stopped and resumed: SIGTERM -> save -> exit 42 -> resume with the same losses; bad
input -> one `error:` line. (kill -9 in the middle of an async save: test_faults_checkpoint.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxscale.errors import RESTART_EXIT_CODE, USAGE_EXIT_CODE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL_MODEL = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128)


def flags(workdir, steps, model=SMALL_MODEL, **checkpoint):
    train = dict(steps=steps, seq_len=32, batch_size=8, log_every=1, eval_every=0)
    return ([f"--workdir={workdir}"]
            + [f"--config.train.{k}={v}" for k, v in train.items()]
            + [f"--config.model.{k}={v}" for k, v in model.items()]
            + [f"--config.checkpoint.{k}={v}" for k, v in checkpoint.items()])


def start(args):
    return subprocess.Popen([sys.executable, "-m", "jaxscale.train", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def train(args):
    result = subprocess.run([sys.executable, "-m", "jaxscale.train", *args], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


def metrics(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def wait_for_step(process, workdir, step):
    """Waits until `process` has logged `step`; fails if it exits first."""
    while not any(line.get("step", 0) >= step for line in metrics(workdir)):
        assert process.poll() is None, process.stdout.read()[-3000:]
        time.sleep(0.01)


def losses(workdir):
    """{step: loss} from metrics.jsonl; fails if a step was logged twice."""
    lines = [line for line in metrics(workdir) if "loss" in line]
    steps = [line["step"] for line in lines]
    assert len(steps) == len(set(steps)), steps
    return {line["step"]: line["loss"] for line in lines}


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_with_bitwise_the_same_losses(tmp_path):
    steps = 40
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, output = train(flags(straight, steps))
    assert code == 0, output[-3000:]
    assert os.listdir(straight / "compilation_cache")  # what a restart loads instead of compiling

    process = start(flags(resumed, steps, every_steps=1000))
    wait_for_step(process, resumed, 5)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == RESTART_EXIT_CODE, output[-3000:]
    stopped_at = max(losses(resumed))
    assert f"preempted at step {stopped_at}: checkpoint " in output
    assert f"checkpoints/{stopped_at} saved; exiting to be restarted" in output
    assert os.listdir(resumed / "checkpoints") == [str(stopped_at)]

    code, output = train(flags(resumed, steps, every_steps=1000))
    assert code == 0, output[-3000:]
    assert f"restored {resumed}/checkpoints/{stopped_at}" in output
    assert losses(resumed) == losses(straight)  # every step 1..steps, bitwise equal

    first_after_restart = next(l for l in metrics(resumed) if l["step"] == stopped_at + 1)
    assert first_after_restart["restarts"] == 1
    assert first_after_restart["restore_seconds"] > 0
    assert 0 < first_after_restart["goodput"] < 1
    saves = [l for l in metrics(resumed) if "checkpoint_blocking_seconds" in l]
    assert saves and all(l["checkpoint_seconds"] >= l["checkpoint_blocking_seconds"]
                         for l in saves if "checkpoint_seconds" in l)


def one_error_line(code, output):
    assert code == USAGE_EXIT_CODE, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


@pytest.mark.slow
def test_bad_checkpoint_input_is_one_error_line_and_touches_no_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    code, output = train(flags(workdir, 2))
    assert code == 0, output[-3000:]
    before = sorted((str(p), p.stat().st_mtime_ns) for p in (workdir / "checkpoints").rglob("*"))

    wider = dict(SMALL_MODEL, mlp_dim=256)
    error = one_error_line(*train(flags(workdir, 2, model=wider)))
    assert "does not fit the model config: parameter 'blocks/mlp/down'" in error

    (tmp_path / "a_file").write_text("not a folder")
    error = one_error_line(*train(flags(workdir, 2, dir=tmp_path / "a_file" / "checkpoints")))
    assert "cannot be written" in error

    error = one_error_line(*train(flags(tmp_path / "new", 2, restore_from=tmp_path / "nowhere")))
    assert "does not exist" in error

    after = sorted((str(p), p.stat().st_mtime_ns) for p in (workdir / "checkpoints").rglob("*"))
    assert after == before
