"""Training throughput (tokens/s, model FLOPs, MFU) and the metric writers used by process 0.

A `MetricsWriter` sends each step's scalars to three places: a compact line on the console, one
JSON object per line in `<workdir>/metrics.jsonl` (easy to load with pandas, survives a crash), and
TensorBoard event files in `<workdir>/tensorboard/`. A vector metric (an MoE layer's per-expert
load) goes to the JSON line as a list and to TensorBoard as a histogram over its index.
"""

import json
import os
import sys
from time import monotonic

import numpy as np
import tensorboardX

from jaxscale.observe.progress import StatusLine

_BAR_WIDTH = 30
# Redraw the progress bar at most this often (seconds): fast steps would otherwise spend their
# time writing to the terminal.
_BAR_MIN_INTERVAL = 0.1


def throughput(*, steps: int, seconds: float, tokens: float, flops_per_token: float,
               num_devices: int, peak_flops_per_device: float | None) -> dict:
    """Speed over `steps` steps that took `seconds` and trained on `tokens` loss-bearing tokens
    (padding excluded: a packed batch's empty tail is work, not progress); `mfu` only when the
    peak is known."""
    if steps <= 0 or seconds <= 0:
        raise ValueError(f"throughput needs steps > 0 and seconds > 0, got {steps=} {seconds=}")
    tokens_per_sec = tokens / seconds
    flops_per_sec_per_device = tokens_per_sec / num_devices * flops_per_token
    result = {
        "step_time": seconds / steps,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_device": tokens_per_sec / num_devices,
        "tflops_per_device": flops_per_sec_per_device / 1e12,
    }
    if peak_flops_per_device:
        result["mfu"] = flops_per_sec_per_device / peak_flops_per_device
    return result


def _format_value(name: str, value: float | int) -> str:
    if name.endswith("mfu"):
        return f"{value:.1%}"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _to_scalar(value) -> float | int:
    """A Python number from an int, float, numpy or JAX scalar (JSON can't encode the others)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return float(value)


class MetricsWriter:
    """Writes metrics to the console, `metrics.jsonl` and TensorBoard; a no-op when not enabled.

    Only process 0 should pass `enabled=True`: the files are shared by all hosts of a run.
    """

    def __init__(self, workdir: str, *, enabled: bool, total_steps: int, stream=sys.stdout):
        self._enabled = enabled
        self._total_steps = total_steps
        self._stream = stream
        self._bar = StatusLine(stream, _BAR_MIN_INTERVAL)
        self._bar_start = None  # (step, time) of the first progress() call
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        # Append, so a resumed run keeps the lines of the run it continues.
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
        self._tensorboard = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        """Record `metrics` at `step`; keys get `prefix` (e.g. "eval_") in the console and JSONL."""
        if not self._enabled:
            return
        vectors = {name: [float(x) for x in value] for name, value in metrics.items()
                   if np.ndim(value)}
        scalars = {prefix + name: _to_scalar(value) for name, value in metrics.items()
                   if name not in vectors}
        self._bar.clear()
        fields = [f"step {step}"] + [f"{k} {_format_value(k, v)}" for k, v in scalars.items()]
        print(" | ".join(fields), file=self._stream, flush=True)
        lists = {prefix + name: value for name, value in vectors.items()}
        self._jsonl.write(json.dumps({"step": step, **scalars, **lists}) + "\n")
        self._jsonl.flush()  # a crash must not lose the lines before it
        tag_group = prefix.rstrip("_") or "train"
        for name in metrics:
            if name in vectors:
                self._add_histogram(f"{tag_group}/{name}", vectors[name], step)
            else:
                self._tensorboard.add_scalar(f"{tag_group}/{name}", scalars[prefix + name], step)
        self._tensorboard.flush()

    def _add_histogram(self, tag: str, values: list[float], step: int) -> None:
        """`values` as a histogram whose x axis is their index: bucket [i, i + 1) holds
        values[i] (expert i's share of the load), so the chart shows the load expert by
        expert."""
        index = np.arange(len(values), dtype=np.float64)
        weights = np.asarray(values, np.float64)
        self._tensorboard.add_histogram_raw(
            tag, min=0.0, max=float(len(values)), num=float(weights.sum()),
            sum=float(index @ weights), sum_squares=float((index ** 2) @ weights),
            bucket_limits=(index + 1).tolist(), bucket_counts=weights.tolist(),
            global_step=step)

    def progress(self, step: int) -> None:
        """Redraw the one-line progress bar; only on a terminal, so logs stay free of `\\r`."""
        if not (self._enabled and self._bar.interactive):
            return
        now = monotonic()
        if self._bar_start is None:
            self._bar_start = (step, now)
        if self._bar.due(now) or step >= self._total_steps:
            self._bar.draw(self._bar_line(step, now), now)

    def _bar_line(self, step: int, now: float) -> str:
        fraction = min(max(step / self._total_steps, 0.0), 1.0) if self._total_steps else 1.0
        filled = round(fraction * _BAR_WIDTH)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        # Rate since the first call, not since step 0: a resumed run starts in the middle.
        start_step, start_time = self._bar_start
        elapsed = now - start_time
        rate = (step - start_step) / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            eta = _format_duration(max(self._total_steps - step, 0) / rate)
        else:
            eta = "?"
        return f"[{bar}] {step}/{self._total_steps} | {rate:.2f} steps/s | ETA {eta}"

    def close(self) -> None:
        """Flush and close the files; safe to call twice."""
        if not self._enabled:
            return
        self._bar.finish()  # leave the finished bar on screen, the prompt below it
        self._jsonl.close()
        self._tensorboard.close()
        self._enabled = False

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
