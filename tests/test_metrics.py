import glob
import io
import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxscale.observe import metrics, timing
from jaxscale.observe.progress import is_interactive
from jaxscale.runtime.chips import peak_flops_per_device


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def read_jsonl(workdir):
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def event_files(workdir):
    return glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))


def tensorboard_values(path):
    """(step, summary value) of each value in a TFRecord event file: u64 length, u32 crc, data,
    u32 crc."""
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            yield event.step, value


def read_tensorboard_scalars(path):
    """{(tag, step): value} of an event file's values (0.0 for those that are not scalars)."""
    return {(value.tag, step): value.simple_value for step, value in tensorboard_values(path)}


@pytest.mark.parametrize("device_kind, tflops", [
    ("NVIDIA H100 80GB HBM3", 989),
    ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H200", 989),
    ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100-SXM4-40GB", 312),
    ("TPU v4", 275),
    ("TPU v5 lite", 197),
    ("TPU v5e", 197),
    ("TPU v5p", 459),
    ("TPU v5", 459),
    ("TPU v6 lite", 918),
    ("TPU v6e", 918),
    ("tpu V6E", 918),
])
def test_peak_flops_of_known_devices(device_kind, tflops):
    assert peak_flops_per_device(device_kind) == tflops * 1e12


@pytest.mark.parametrize("device_kind", ["cpu", "TFRT_CPU_0", "NVIDIA GeForce RTX 4090", "TPU v3",
                                         "TPU v4 lite", ""])
def test_peak_flops_of_cpus_and_unknown_devices_is_none(device_kind):
    assert peak_flops_per_device(device_kind) is None


def test_throughput_matches_the_closed_form():
    steps, seconds, total_tokens, fpt, devices, peak = 10, 4.0, 18_000, 1.5e9, 8, 2e14
    result = metrics.throughput(steps=steps, seconds=seconds, tokens=total_tokens,
                                flops_per_token=fpt, num_devices=devices,
                                peak_flops_per_device=peak)
    assert result["step_time"] == pytest.approx(seconds / steps)
    assert result["tokens_per_sec"] == pytest.approx(total_tokens / seconds)
    assert result["tokens_per_sec_per_device"] == pytest.approx(total_tokens / seconds / devices)
    total_flops = total_tokens * fpt
    assert result["tflops_per_device"] == pytest.approx(total_flops / seconds / devices / 1e12)
    assert result["mfu"] == pytest.approx(total_flops / (seconds * devices * peak))
    assert 0 < result["mfu"] < 1


def test_throughput_has_no_mfu_without_a_peak():
    result = metrics.throughput(steps=1, seconds=1.0, tokens=1, flops_per_token=1.0,
                                num_devices=1, peak_flops_per_device=None)
    assert "mfu" not in result
    assert set(result) == {"step_time", "tokens_per_sec", "tokens_per_sec_per_device",
                           "tflops_per_device"}


def test_throughput_rejects_zero_seconds():
    with pytest.raises(ValueError, match="seconds"):
        metrics.throughput(steps=1, seconds=0.0, tokens=1, flops_per_token=1.0,
                           num_devices=1, peak_flops_per_device=None)


def test_write_appends_json_lines_with_prefixed_keys(tmp_path):
    workdir = str(tmp_path / "run")
    with metrics.MetricsWriter(workdir, enabled=True, total_steps=10,
                               stream=io.StringIO()) as writer:
        writer.write(1, {"loss": jnp.float32(2.5), "lr": 1e-3})
        writer.write(2, {"loss": np.float32(1.25), "tokens": 4096})
        writer.write(2, {"loss": 1.5}, prefix="eval_")
    assert read_jsonl(workdir) == [
        {"step": 1, "loss": 2.5, "lr": 1e-3},
        {"step": 2, "loss": 1.25, "tokens": 4096},
        {"step": 2, "eval_loss": 1.5},
    ]


def test_jsonl_line_is_on_disk_before_close(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10,
                                   stream=io.StringIO())
    writer.write(3, {"loss": 0.5})
    assert read_jsonl(str(tmp_path)) == [{"step": 3, "loss": 0.5}]
    writer.close()


def test_reopening_keeps_the_lines_of_the_earlier_run(tmp_path):
    for step in (1, 2):
        with metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10,
                                   stream=io.StringIO()) as writer:
            writer.write(step, {"loss": float(step)})
    assert read_jsonl(str(tmp_path)) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_write_prints_one_readable_line(tmp_path):
    stream = io.StringIO()
    with metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10,
                               stream=stream) as writer:
        writer.write(120, {"loss": 2.31412, "grad_norm": 0.81, "tokens_per_sec": 12000.0,
                           "mfu": 0.4134})
    assert stream.getvalue() == (
        "step 120 | loss 2.314 | grad_norm 0.81 | tokens_per_sec 1.2e+04 | mfu 41.3%\n")


def test_write_records_tensorboard_scalars(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10,
                               stream=io.StringIO()) as writer:
        writer.write(5, {"loss": 2.5})
        writer.write(5, {"loss": 3.0}, prefix="eval_")
    (path,) = event_files(str(tmp_path))
    assert os.path.getsize(path) > 0
    scalars = read_tensorboard_scalars(path)
    assert scalars[("train/loss", 5)] == 2.5
    assert scalars[("eval/loss", 5)] == 3.0


def test_disabled_writer_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    stream = FakeTerminal()
    with metrics.MetricsWriter(str(workdir), enabled=False, total_steps=10,
                               stream=stream) as writer:
        writer.progress(1)
        writer.write(1, {"loss": 1.0})
    assert not workdir.exists()
    assert stream.getvalue() == ""


def test_progress_prints_nothing_when_not_a_terminal(tmp_path):
    stream = io.StringIO()
    with metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10,
                               stream=stream) as writer:
        for step in range(11):
            writer.progress(step)
    assert stream.getvalue() == ""


def test_progress_redraws_one_line_with_rate_and_eta(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics, "monotonic", clock)
    stream = FakeTerminal()
    writer = metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=100, stream=stream)
    writer.progress(10)
    clock.now = 10.0
    writer.progress(20)  # 10 steps in 10 s: 80 steps left take 80 s
    last_draw = stream.getvalue().split("\r")[-1]
    assert "\n" not in stream.getvalue()
    assert "20/100" in last_draw
    assert "1.00 steps/s" in last_draw
    assert "ETA 0:01:20" in last_draw
    writer.close()
    assert stream.getvalue().endswith("\n")


def test_progress_skips_redraws_closer_than_the_minimum_interval(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(metrics, "monotonic", clock)
    stream = FakeTerminal()
    with metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=100,
                               stream=stream) as writer:
        writer.progress(1)
        writer.progress(2)
        assert stream.getvalue().count("\r") == 1


def test_write_clears_the_progress_bar_first(tmp_path):
    stream = FakeTerminal()
    with metrics.MetricsWriter(str(tmp_path), enabled=True, total_steps=10,
                               stream=stream) as writer:
        writer.progress(1)
        bar = stream.getvalue()
        writer.write(1, {"loss": 1.0})
    after_bar = stream.getvalue()[len(bar):]
    # The whole bar is overwritten with spaces and the cursor returned before the line.
    assert after_bar.startswith("\r" + " " * (len(bar) - 1) + "\rstep 1 | loss 1\n")


def test_is_interactive():
    assert is_interactive(FakeTerminal())
    assert not is_interactive(io.StringIO())
    closed = io.StringIO()
    closed.close()
    assert not is_interactive(closed)


def test_throughput_counts_the_loss_bearing_tokens_of_the_timed_steps_not_the_padding():
    """Four steps of a 4 x 16 batch (64 slots each) whose rows are partly padding: the first step
    is timed apart, so tokens/s times seconds per step is the mean real-token count of the other
    three (30), not the 64 slots; the start's total counts all four."""
    speed = timing.Speed(flops_per_token=6.0, num_devices=2, peak_flops_per_device=None)
    window = timing.StepWindow(speed, timing.RunClock("unused", enabled=False), started_at=0.0)
    for tokens in (10.0, 20.0, 30.0, 40.0):
        window.add(dict(loss=np.float32(1.0), grad_norm=np.float32(1.0), lr=np.float32(0.1),
                        skipped=np.int32(0), tokens=np.float32(tokens)))
    summary = window.summary()
    assert summary["tokens_per_sec"] * summary["step_time"] == pytest.approx(30.0)
    assert summary["tflops_per_device"] * 1e12 == pytest.approx(
        summary["tokens_per_sec"] / 2 * 6.0)
    assert window.tokens == 100.0
    # A skipped step (its update dropped; a poisoned loss mask makes its count NaN) adds nothing.
    for tokens, skipped in ((50.0, 0), (float("nan"), 1)):
        window.add(dict(loss=np.float32(1.0), grad_norm=np.float32(1.0), lr=np.float32(0.1),
                        skipped=np.int32(skipped), tokens=np.float32(tokens)))
    summary = window.summary()
    assert summary["tokens_per_sec"] * summary["step_time"] == pytest.approx(25.0)
    assert window.tokens == 150.0
