"""Timing a run: the steps of a logging window (throughput, MFU, data wait), and the run's
restarts and goodput, counted across the processes that resume it.

Goodput is the share of wall time since the run first started that went into training steps that
count. Start-up, compilation, restoring, eval, the blocking part of checkpoint saves, and steps
redone after a restart do not count: the productive seconds travel inside each checkpoint, so the
steps a crash loses (those after the last checkpoint) drop out when the run resumes. When the run
first started and how many times it has started live in `<workdir>/run.json`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import jax
import numpy as np

from jaxscale.errors import JaxscaleError, json_object
from jaxscale.observe.metrics import throughput
from jaxscale.runtime.agreement import gathered
from jaxscale.runtime.storage import writing
from jaxscale.runtime.workdir import WORKDIR_FIX

RUN_RECORD = "run.json"
_RECORD_FIX = ("it holds the run's first start time and start count as jaxscale.train writes "
               "them: restore it, or delete it to count the run's time from this start")


def read_run_record(workdir: str) -> dict | None:
    """What `<workdir>/run.json` holds, None without one; JaxscaleError when it is not the JSON
    object jaxscale.train writes."""
    path = os.path.join(workdir, RUN_RECORD)
    with writing(path, WORKDIR_FIX):  # a read that fails is classified as a write is
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            data = f.read()
    try:
        record = json.loads(data)
    except ValueError as e:  # also UnicodeDecodeError
        raise JaxscaleError(f"{path} is not JSON ({e}); {_RECORD_FIX}") from None
    return json_object(record, path, _RECORD_FIX)


class RunClock:
    """Reads and updates `<workdir>/run.json`; only process 0 should pass `enabled=True`."""

    def __init__(self, workdir: str, *, enabled: bool):
        self.started_at, self.restarts = time.time(), 0
        if not enabled:
            return
        path = os.path.join(workdir, RUN_RECORD)
        record = read_run_record(workdir) or {"started_at": self.started_at, "starts": 0}
        with writing(path, WORKDIR_FIX):
            record["starts"] += 1
            # Written whole then renamed: a crash mid-write must not lose the run's start time.
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
        self.started_at, self.restarts = record["started_at"], record["starts"] - 1

    def goodput(self, productive_seconds: float) -> float:
        return productive_seconds / max(time.time() - self.started_at, 1e-9)


@dataclasses.dataclass(frozen=True)
class Speed:
    """What turns step time and tokens into throughput: `jaxscale.observe.metrics.throughput`'s
    constants."""
    flops_per_token: float
    num_devices: int
    peak_flops_per_device: float | None


class StepWindow:
    """The steps since the last log line: their device-side metrics and their wall time.

    Step metrics stay on the device until `summary()`, the one device->host sync per window. The
    first step of a run is timed alone (it includes compilation) and reported as
    `time_to_first_step`, with the other `first_line` metrics (restarts, restore time); throughput
    covers the later steps of the window only. Timed step time adds up to the run's productive
    time, the numerator of goodput.
    """

    def __init__(self, speed: Speed, run_clock: RunClock, started_at: float,
                 productive_seconds: float = 0.0, **first_line: float):
        self.speed = speed
        self.run_clock = run_clock
        self.started_at = started_at  # perf_counter() when the process began the run
        self.metrics: list[dict] = []
        self.timed_steps = 0
        self.start: float | None = None  # None until the first step has finished
        self.data_wait = 0.0
        self.device_wait = 0.0  # blocked on the devices (StepsInFlight): not the host's own time
        # Productive seconds of earlier processes of this run (from the checkpoint) and of the
        # windows this process has closed.
        self.productive = productive_seconds
        self.tokens = 0.0  # loss-bearing tokens of the applied steps summarised so far, this start
        self.first_line = first_line  # reported on the first log line, with time_to_first_step

    @contextlib.contextmanager
    def waiting_for_data(self):
        begin = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - begin

    @contextlib.contextmanager
    def waiting_for_devices(self):
        begin = time.perf_counter()
        yield
        self.device_wait += time.perf_counter() - begin

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (e.g. eval) does not count as step time."""
        begin = time.perf_counter()
        yield
        if self.start is not None:
            self.start += time.perf_counter() - begin

    def add(self, step_metrics: dict) -> None:
        self.metrics.append(step_metrics)
        if self.start is None:
            jax.block_until_ready(step_metrics)
            self.start = time.perf_counter()
            self.first_line["time_to_first_step"] = self.start - self.started_at
            self.data_wait = self.device_wait = 0.0
        else:
            self.timed_steps += 1

    def productive_seconds(self) -> float:
        """Step time of the whole run so far: compilation, restoring, eval and checkpoint blocking
        excluded; steps an earlier process did after its last checkpoint excluded too."""
        if self.start is None:
            return self.productive
        return self.productive + time.perf_counter() - self.start

    def summary(self) -> dict[str, float]:
        with self.waiting_for_devices():
            fetched = jax.device_get(self.metrics)
        # Averages over the steps that counted: a skipped step's inf/NaN would hide the others.
        finite = [m for m in fetched if not m["skipped"]] or fetched
        summary = {k: float(np.mean([m[k] for m in finite])) for k in ("loss", "grad_norm")}
        for k in fetched[-1]:
            if k.startswith("moe_"):  # the routers' statistics; the expert load stays a vector
                mean = np.mean([m[k] for m in finite], axis=0)
                summary[k] = mean.tolist() if mean.ndim else float(mean)
        summary["lr"] = float(fetched[-1]["lr"])
        summary["skipped_steps"] = int(sum(m["skipped"] for m in fetched))
        # Tokens count where the model learnt from them: a skipped step's update was dropped.
        self.tokens += float(sum(m["tokens"] for m in fetched if not m["skipped"]))
        if "loss_scale" in fetched[-1]:
            summary["loss_scale"] = float(fetched[-1]["loss_scale"])
        now = time.perf_counter()
        if self.timed_steps:
            seconds = now - self.start
            # The timed steps are the window's last ones (a run's first step is timed apart).
            tokens = float(sum(m["tokens"] for m in fetched[-self.timed_steps:]
                               if not m["skipped"]))
            summary.update(throughput(steps=self.timed_steps, seconds=seconds, tokens=tokens,
                                      **dataclasses.asdict(self.speed)))
            summary["data_wait_fraction"] = self.data_wait / seconds
            # What the host spent per step on its own work (data, dispatch, Python), not waiting
            # for the devices: the measure that tells a slow host apart in a job whose hosts all
            # step together.
            summary["host_time"] = (seconds - self.device_wait) / self.timed_steps
        self.productive += now - self.start
        summary["goodput"] = self.run_clock.goodput(self.productive)
        summary.update(self.first_line)
        self.first_line = {}
        self.metrics, self.timed_steps, self.data_wait, self.device_wait = [], 0, 0.0, 0.0
        self.start = now
        return summary


def compare_hosts(summary: dict[str, float], straggler_ratio: float
                  ) -> tuple[dict[str, float], str | None]:
    """Every process's step time, data wait and host time from this window's `summary`, gathered
    (a collective: every process calls it at the same logging steps; no other step syncs).

    Returns the metrics process 0 logs (`step_time_max_host_s`, `slowest_host`, ...) and a
    warning when the slowest host's own time per step exceeds the median host's by more than
    `straggler_ratio - 1` of the median step: in a job whose hosts step together, that host makes
    every step about that much longer.
    """
    if jax.process_count() == 1 or "step_time" not in summary:
        return {}, None
    mine = np.array([summary["step_time"], summary["data_wait_fraction"], summary["host_time"]])
    step_time, data_wait, host_time = gathered(mine).T
    slowest = int(np.argmax(host_time))
    median_step, median_host = float(np.median(step_time)), float(np.median(host_time))
    metrics = {"step_time_max_host_s": float(step_time.max()), "slowest_host": slowest,
               "host_time_max_s": float(host_time[slowest]), "host_time_median_s": median_host,
               "data_wait_fraction_max_host": float(data_wait.max())}
    excess = float(host_time[slowest]) - median_host
    warning = None
    if excess > (straggler_ratio - 1) * median_step:
        warning = (f"warning: host {slowest} is slow: it spends {host_time[slowest]:.3g}s of "
                   f"each {median_step:.3g}s step on its own work (data wait "
                   f"{data_wait[slowest]:.0%}) against {median_host:.3g}s on the median host, "
                   f"which adds about {excess / median_step:.0%} to every step of every host "
                   f"(train.straggler_ratio={straggler_ratio})")
    return metrics, warning
