"""The README's run command works: the default config trains a few steps and writes metrics."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
