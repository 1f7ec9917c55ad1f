"""Training throughput (tokens/s, model FLOPs, MFU) and the metric writer used by process 0.

A `MetricsWriter` prints each logged step's scalars as a compact line on the console and hands the
step to the trackers `metrics.trackers` chooses (jaxscale/observe/trackers.py): by default
`<workdir>/metrics.jsonl` (one JSON object per line, easy to load with pandas, survives a crash)
and TensorBoard event files in `<workdir>/tensorboard/`; W&B and MLflow when asked for.
"""

import os
import sys
from time import monotonic

import ml_collections
import numpy as np

from jaxscale.config import default_config
from jaxscale.errors import ConfigError, TransientError
from jaxscale.observe import trackers as trackers_lib
from jaxscale.observe.progress import StatusLine
from jaxscale.runtime.storage import writing
from jaxscale.runtime.workdir import WORKDIR_FIX

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
    """Writes metrics to the console and the chosen trackers; a no-op when not enabled.

    Only process 0 should pass `enabled=True`: the files are shared by all hosts of a run.
    `config` is the run's: its `metrics` section chooses the trackers, and W&B and MLflow record
    it. Without one, the default trackers (JSONL and TensorBoard, which record no config).
    """

    def __init__(self, workdir: str, *, enabled: bool, total_steps: int,
                 config: ml_collections.ConfigDict | None = None, stream=None):
        self._enabled = enabled
        self._total_steps = total_steps
        # sys.stdout as it is now, not as it was at import: a notebook or a test swaps it.
        stream = stream or sys.stdout
        self._stream = stream
        self._bar = StatusLine(stream, _BAR_MIN_INTERVAL)
        self._bar_start = None  # (step, time) of the first progress() call
        self._trackers = []
        if not enabled:
            return
        try:
            with writing(workdir, WORKDIR_FIX):
                os.makedirs(workdir, exist_ok=True)
            for tracker in trackers_lib.open_trackers(
                    workdir, default_config() if config is None else config):
                self._trackers.append(tracker)
        except BaseException:
            self._close_trackers(failed=True)  # those already open: a W&B run, an open file
            raise

    def write(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        """Record `metrics` at `step`; keys get `prefix` (e.g. "eval_") in the console and JSONL
        (`eval/` in TensorBoard, W&B and MLflow)."""
        if not self._enabled:
            return
        values = {name: [float(x) for x in value] if np.ndim(value) else _to_scalar(value)
                  for name, value in metrics.items()}
        self._bar.clear()
        fields = [f"step {step}"] + [f"{prefix}{k} {_format_value(k, v)}"
                                     for k, v in values.items() if not isinstance(v, list)]
        print(" | ".join(fields), file=self._stream, flush=True)
        for tracker in self._trackers:
            tracker.write(step, values, prefix)

    def write_samples(self, step: int, samples: dict[str, str]) -> None:
        """Record `samples` (prompt -> continuation) at `step`: a console line each, and text in
        every tracker."""
        if not self._enabled:
            return
        self._bar.clear()
        for prompt, text in samples.items():
            print(f"step {step} | sample {prompt!r} -> {text!r}", file=self._stream, flush=True)
        for tracker in self._trackers:
            tracker.write_samples(step, samples)

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

    def close(self, failed: bool = False) -> None:
        """Flush and close the trackers, marking their runs failed if `failed`; safe to call
        twice."""
        if not self._enabled:
            return
        self._bar.finish()  # leave the finished bar on screen, the prompt below it
        self._close_trackers(failed)
        self._enabled = False

    def _close_trackers(self, failed: bool) -> None:
        while self._trackers:
            tracker = self._trackers.pop()
            try:
                tracker.close(failed)
            except (ConfigError, TransientError):  # its file could not be written
                if not failed:
                    raise
                # The run is stopping for an error already (often the same: a full disk fails
                # the last flush again); that error is the one to report.

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(failed=exc_type is not None)
