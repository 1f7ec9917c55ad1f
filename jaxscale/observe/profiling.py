"""A profiler window: a `jax.profiler` trace of a few chosen training steps.

    --config.profile.start_step=100 --config.profile.steps=5

traces steps 100..104 (a step's number is the state's step count before it, as in
`StepTraceAnnotation("train", step_num=...)`, which marks every step so the trace viewer lines
steps up). Each traced process writes `<workdir>/profile/process_<i>/plugins/profile/<time>/
<host>.xplane.pb` (TensorBoard's profile plugin and Perfetto read it; docs/performance.md): one
folder per process, because processes on one host would otherwise write the same file name.

Only process 0 traces unless `profile.all_processes`. A run that resumes inside the window traces
the rest of it; a run that stops inside it (SIGTERM, Ctrl-C, an error, the last step) ends the
trace on `close()`, so the file is still written.
"""

from __future__ import annotations

import contextlib
import os

import jax
import ml_collections

from jaxscale.errors import ConfigError

PROFILE_SUBDIR = "profile"


def check_window(profile: ml_collections.ConfigDict, total_steps: int) -> None:
    """ConfigError unless the window lies within the run's steps 0 .. total_steps - 1."""
    if profile.steps < 0:
        raise ConfigError(f"profile.steps={profile.steps} must be >= 0 (0 turns profiling off)")
    if not profile.steps:
        return
    if profile.start_step < 0 or profile.start_step + profile.steps > total_steps:
        raise ConfigError(
            f"profile.start_step={profile.start_step} with profile.steps={profile.steps} traces "
            f"steps outside the run's steps 0..{total_steps - 1} (train.steps={total_steps}); "
            f"pick a start_step between 0 and {max(total_steps - profile.steps, 0)}")


def profile_dir(workdir: str, process_index: int) -> str:
    return os.path.join(workdir, PROFILE_SUBDIR, f"process_{process_index}")


class ProfileWindow:
    """In the loop: `with window.annotate(step): outputs = train_step(...)`, then
    `window.step_done(step, outputs)`; `close()` when the loop ends, however it ends."""

    def __init__(self, profile: ml_collections.ConfigDict, workdir: str):
        process = jax.process_index()
        self.enabled = profile.steps > 0 and (profile.all_processes or process == 0)
        self.start, self.end = profile.start_step, profile.start_step + profile.steps
        self.directory = profile_dir(workdir, process)
        self.tracing = False

    @contextlib.contextmanager
    def annotate(self, step: int):
        """Starts the trace at the window's first step (or the first of it this run reaches) and
        marks the step (cheap when no trace is running)."""
        if self.enabled and not self.tracing and self.start <= step < self.end:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory)
            self.tracing = True
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield

    def step_done(self, step: int, outputs) -> None:
        """Ends the trace after the window's last step, once the devices have finished it."""
        if self.tracing and step + 1 >= self.end:
            self.close(outputs)

    def close(self, outputs=None) -> None:
        """Ends the trace, if one is running, after waiting for `outputs` so that the devices'
        work of the traced steps is in it."""
        if not self.tracing:
            return
        if outputs is not None:
            jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self.tracing = False
