"""The command line and a run's life: the README's run command, `--help`, a finished run, the
summary line, a fresh start over an earlier one's metrics."""

import json
import os
import subprocess
import sys

import pytest

from jaxscale.runtime.workdir import latest_metrics
from jaxscale.trainer import Trainer
from tests.helpers import resumable_cli_losses, small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_default_config_trains_and_writes_metrics(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a newcomer's laptop
    # Run from another folder with a relative workdir, as the README's command does.
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", "--workdir=runs/cli",
         "--config.train.steps=4", "--config.train.log_every=2", "--config.train.eval_every=4",
         "--config.train.eval_batches=1", "--config.train.seq_len=64",
         "--config.checkpoint.every_steps=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    tmp_path = tmp_path / "runs" / "cli"
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_lines = [l for l in lines if "loss" in l]
    assert [l["step"] for l in train_lines] == [2, 4]
    assert all(l["loss"] > 0 and l["tokens_per_sec"] > 0 for l in train_lines[1:])
    assert "mfu" not in train_lines[-1]  # unknown peak on CPU: left out, not invented
    assert any("eval_loss" in l for l in lines)
    assert (tmp_path / "config.json").exists()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))


@pytest.mark.parametrize("module, flags", [
    ("jaxscale.train", ["--config=FILE", "--workdir=DIR", "--config.KEY=VALUE"]),
    ("jaxscale.data.prepare", ["--config=FILE", "--out=DIR", "--workers=N", "--config.KEY=VALUE"]),
])
def test_help_lists_every_flag_with_a_sentence(module, flags):
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m {module}")
    for flag in flags:
        described = [l for l in result.stdout.splitlines() if l.strip().startswith(flag)]
        assert described and len(described[0].split(flag, 1)[1].split()) >= 3, flag


def small_run_config(steps):
    config = small_config(data=8)
    config.train.update(steps=steps, log_every=2, eval_every=2, eval_batches=1)
    config.checkpoint.compilation_cache = False
    return config


def test_a_finished_run_says_so_and_returns_its_last_metrics(tmp_path, capsys):
    metrics = Trainer(small_run_config(2), str(tmp_path)).run()
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("done: step 2, 2 steps (256 tokens) in ")
    assert f"checkpoint {tmp_path / 'checkpoints' / '2'}" in summary
    assert f"loss {metrics['loss']:.4g}" in summary
    before = files_and_times(tmp_path)

    again = Trainer(small_run_config(2), str(tmp_path)).run()
    out = capsys.readouterr().out
    assert "already complete at step 2 (train.steps=2)" in out
    assert "--config.train.steps=<more than 2>" in out
    assert again["step"] == 2
    assert again["loss"] == metrics["loss"] and again["eval_loss"] == metrics["eval_loss"]
    assert files_and_times(tmp_path) == before  # nothing written


def files_and_times(folder):
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_fresh_start_over_metrics_without_a_checkpoint_sets_them_aside(tmp_path, capsys):
    config = small_run_config(2)
    config.checkpoint.enabled = False
    Trainer(config, str(tmp_path)).run()
    first = (tmp_path / "metrics.jsonl").read_text()
    Trainer(config, str(tmp_path)).run()
    assert "has metrics of an earlier start but no checkpoint" in capsys.readouterr().out
    earlier = [p for p in tmp_path.iterdir() if p.name.startswith("earlier-")]
    assert len(earlier) == 1 and (earlier[0] / "metrics.jsonl").read_text() == first
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in l]
    assert steps == [2, 2]  # one train line, one eval line: no step logged twice


def test_a_torn_metrics_line_does_not_hide_the_others(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 3.5}\n{"step": 4, "lo')
    assert latest_metrics(str(tmp_path)) == {"step": 2, "loss": 3.5}


@pytest.mark.slow
def test_a_restart_loads_the_train_step_from_the_compilation_cache(tmp_path):
    """A second start of the same program compiles no train step: its cache key is the first
    start's (no path of the cache's staging folder is in it: tests/test_restart_cache.py). Two
    workdirs share the cache, so both starts compile the very same program."""
    cache = tmp_path / "cache"
    flags = {"checkpoint.compilation_cache": True, "checkpoint.compilation_cache_dir": cache}
    resumable_cli_losses(tmp_path / "first", 2, **flags)
    train_steps = {name for name in os.listdir(cache) if "train_step" in name}
    assert train_steps  # the first start wrote its program
    resumable_cli_losses(tmp_path / "second", 2, **flags)
    assert {name for name in os.listdir(cache) if "train_step" in name} == train_steps
