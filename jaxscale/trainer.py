"""Training, readable top to bottom: config -> mesh -> model -> shardings -> state -> step -> loop.

`Trainer(config, workdir)` checks the config for the devices, builds the mesh and the training
program on it (jaxscale/training/program.py: model, optimizer, shardings, the jitted steps;
nothing compiled yet). `run()` then

  1. opens the inputs and checks the data (and the eval split);
  2. checks that the trackers can be opened (an MLflow or W&B server answers in seconds) and
     that the checkpoint and compilation-cache folders can be written;
  3. restores, read-only, this run's newest good checkpoint, else `checkpoint.restore_from`
     (a checkpoint that does not fit the config stops here, before anything is written);
  4. compiles the train step once, ahead of time, and prints its memory per device next to the
     device's capacity: a step that does not fit stops here, before anything is written (the
     memory is also logged on the first metrics line);
  5. writes: the workdir's config.json, run.json, metrics and TensorBoard files;
  6. starts from the restored state or a fresh sharded init, and runs `_Loop`: next batch ->
     train step -> stop signal? -> checkpoint when due -> metrics on logging steps -> eval. A
     `profile` window traces chosen steps (jaxscale/observe/profiling.py).

Nothing is fetched from the devices on steps that neither log nor save; the host stays at most
two steps ahead of the devices, so a stop signal is acted on within two steps.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jaxscale.checkpoint import PERSISTENT, Checkpoints, Restored, lora_base, restore_from
from jaxscale.checkpoint.signals import Preempted, RunStopped, StopSignals
from jaxscale.checks import checked_mesh
from jaxscale.data import Input, check_splits, make_input
from jaxscale.errors import (TRANSIENT_EXIT_CODE, USAGE_EXIT_CODE, ConfigError, JaxscaleError,
                             TransientError)
from jaxscale.inference.samples import TrainingSamples
from jaxscale.observe import metrics as metrics_lib
from jaxscale.observe import run_log
from jaxscale.observe.device_memory import (StepMemory, check_fits, device_capacity, memory_line,
                                            memory_metrics)
from jaxscale.observe.profiling import ProfileWindow
from jaxscale.observe.trackers import check_tracker_access
from jaxscale.observe.timing import RunClock, Speed, StepWindow, compare_hosts
from jaxscale.runtime.chips import GIB, peak_flops_per_device
from jaxscale.runtime.compilation_cache import (CACHE_FIX, CompilationCache,
                                                compilation_cache_dir)
from jaxscale.runtime.workdir import (check_workdir, check_writable, latest_metrics, open_workdir,
                                      set_aside_earlier_start)
from jaxscale.training.bad_steps import BadSteps
from jaxscale.training.program import TrainProgram
from jaxscale.training.state import TrainState

# Room for a failing start-up check's message in the agreement; a longer one is cut.
_AGREED_MESSAGE_BYTES = 4096


@contextlib.contextmanager
def agreed_checks():
    """Runs a block of start-up checks, then makes its verdict every process's: when a check fails
    on some processes (one host's disk, data or memory), all of them raise the error of the first
    (lowest id) of those, of its kind (JaxscaleError: exit 2, TransientError: exit 75), after one
    allgather. Without it the others would go on into the next collective and wait there until
    the heartbeat timeout. The block must hold no collective: a process whose check failed skips
    the rest of it."""
    failure = None
    try:
        yield
    except (JaxscaleError, TransientError) as e:
        failure = e
    if jax.process_count() == 1:
        if failure is not None:
            raise failure
    elif (agreed := _first_failure(failure)) is not None:
        raise agreed from failure


def _first_failure(failure: JaxscaleError | TransientError | None) -> Exception | None:
    """The error every process raises: the first failing process's, the same line on each (with
    that process's id when not every process failed); None when all passed."""
    kind = (0 if failure is None else
            TRANSIENT_EXIT_CODE if isinstance(failure, TransientError) else USAGE_EXIT_CODE)
    message = str(failure or "").encode()[:_AGREED_MESSAGE_BYTES]
    mine = np.zeros(3 + _AGREED_MESSAGE_BYTES, np.uint8)  # kind, message length (2 bytes), message
    mine[:3] = kind, len(message) // 256, len(message) % 256
    mine[3:3 + len(message)] = np.frombuffer(message, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(mine))  # in process order
    failed = [process for process, row in enumerate(rows) if row[0]]
    if not failed:
        return None
    row = rows[failed[0]]
    text = row[3:3 + 256 * int(row[1]) + int(row[2])].tobytes().decode(errors="replace")
    if len(failed) < len(rows):
        text = f"process {failed[0]} of {len(rows)}: {text}"
    return (TransientError if row[0] == TRANSIENT_EXIT_CODE else JaxscaleError)(text)


def devices_kind(mesh) -> str:
    return mesh.devices.flat[0].device_kind


class Trainer:
    """Trains `config` in `workdir`: `Trainer(config, workdir).run()`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices=None,
                 planned_step: tuple[jax.stages.Compiled, StepMemory] | None = None):
        """`planned_step`: with mesh.auto, the planner's compiled train step for `config` (the
        layout it chose, jaxscale.plan.auto.planned_config), which the trainer runs instead of
        compiling its own."""
        self.start_time = time.perf_counter()
        devices = list(devices if devices is not None else jax.devices())
        if config.mesh.auto and planned_step is None:
            raise ConfigError("mesh.auto=True is resolved before the trainer is built: "
                              "`python -m jaxscale.train` plans it; in Python, call "
                              "jaxscale.plan.auto.planned_config(config, devices) and pass its "
                              "config and step to Trainer(config, workdir, planned_step=step)")
        self._planned_step = planned_step
        mesh = checked_mesh(config, devices)
        self.config, self.workdir = config, workdir
        self.is_primary = jax.process_index() == 0
        check_workdir(workdir)
        self.program = TrainProgram(config, mesh)
        self.config = self.program.config  # the step settings left to the device, set
        # This process's devices, whose memory the metrics report.
        self.local_devices = [d for d in mesh.devices.flat
                              if d.process_index == jax.process_index()]
        model = self.program.model
        self.speed = Speed(
            flops_per_token=model.config.flops_per_token(model.num_params, config.train.seq_len,
                                                         model.num_trained),
            num_devices=mesh.size, peak_flops_per_device=peak_flops_per_device(devices_kind(mesh)))

    def compile_train_step(self, capacity: tuple[int, str] | None = None
                           ) -> tuple[jax.stages.Compiled, StepMemory]:
        """The train step compiled for this run's abstract state and batch, and what it needs per
        device; the loop calls it, so nothing compiles twice. The step settings left to the
        device are its first choice whose step fits `capacity` (the program and config become
        that choice's). With mesh.auto it is the planner's compiled step: the same config on
        the same devices, so the same program."""
        if self._planned_step is not None:
            return self._planned_step
        self.program, compiled, memory = self.program.compile_fitting_step(
            capacity[0] if capacity else None)
        self.config = self.program.config
        return compiled, memory

    def say(self, message: str) -> None:
        if self.is_primary:
            print(message, flush=True)

    def run(self) -> dict[str, float]:
        """Trains to `train.steps`, resuming from the newest checkpoint; returns the newest logged
        metrics. On SIGTERM (Ctrl-C) saves and raises `Preempted` (`Interrupted`).

        The start is checked whole before anything is written: the data, the eval split, the
        trackers, the checkpoint folder, whether the checkpoint to resume from fits this config,
        and whether the compiled train step fits the devices' memory. Only then are the workdir's
        files, the compilation cache and the checkpoint manager opened. Every process reaches the
        same verdict (`agreed_checks`): a check that fails on one host stops them all, with its
        error.
        """
        config, t, program = self.config, self.config.train, self.program
        with contextlib.ExitStack() as stack:
            with agreed_checks():  # each process's own checks: no collective in this block
                train_input = stack.enter_context(
                    contextlib.closing(make_input(config, "train", program.batch_sharding)))
                held_out = None
                if t.eval_every:
                    check_splits(config, ("eval",))
                    held_out = stack.enter_context(
                        contextlib.closing(HeldOut(config, program.batch_sharding)))
                if self.is_primary:  # the one process that writes metrics
                    check_tracker_access(config, self.workdir)
                checkpoints = stack.enter_context(Checkpoints(config, self.workdir))
                checkpoints.check_writable()
                if cache_dir := compilation_cache_dir(config, self.workdir):
                    check_writable(cache_dir, "checkpoint.compilation_cache_dir", CACHE_FIX)
            # The restore is collective (every process reads its shards); nothing after it here
            # is, so a process whose check fails skips the rest and goes to the agreement.
            with agreed_checks():
                own, restored, base = self.restore(checkpoints, train_input)
                if own is not None and own.meta["step"] >= t.steps:
                    self.say(f"the run in {self.workdir} is already complete at step "
                             f"{own.meta['step']} (train.steps={t.steps}); to train it further, "
                             f"pass --config.train.steps=<more than {own.meta['step']}>")
                    return latest_metrics(self.workdir)  # once every process agrees
                if own is None and restored is not None and restored.train is not None \
                        and restored.meta["step"] >= t.steps:
                    raise ConfigError(
                        f"checkpoint.restore_from={config.checkpoint.restore_from!r} is at step "
                        f"{restored.meta['step']}, not before train.steps={t.steps}; raise "
                        "train.steps, or start from its parameters only with "
                        "checkpoint.restore_params_only=True")

                self.say(f"jaxscale: {program.model.num_params / 1e6:.2f}M parameters, mesh "
                         f"{dict(program.mesh.shape)} on {program.mesh.size} {devices_kind(program.mesh)} "
                         f"device(s), {jax.process_count()} process(es)")
                if pipeline := program.pipeline:
                    self.say(pipeline.summary())
                cache = stack.enter_context(contextlib.closing(
                    CompilationCache(cache_dir, jax.process_index())))
                capacity = device_capacity(self.local_devices,
                                           config.performance.device_memory_gib)
                # Tests make one process's devices too small with
                # JAXSCALE_TEST_FAIL_CHECK=<process>: its check_fits fails, the others' pass.
                if os.environ.get("JAXSCALE_TEST_FAIL_CHECK") == str(jax.process_index()):
                    capacity = (1, "JAXSCALE_TEST_FAIL_CHECK")
                train_step, memory = self.compile_train_step(capacity)
                config, program = self.config, self.program  # the step settings chosen
                self.say(f"train step: {program.settings.label()}")
                self.say(memory_line(memory, capacity))
                check_fits(memory, capacity)

            # Every check has passed: from here on the run writes.
            if self.is_primary:
                open_workdir(self.workdir, config.to_json_best_effort(indent=2))
                if own is None and (earlier := set_aside_earlier_start(self.workdir)):
                    self.say(f"{self.workdir} has metrics of an earlier start but no checkpoint "
                             f"to resume from; starting from step 0 (the earlier files are in "
                             f"{earlier})")
            run_log.open_file(self.workdir, jax.process_index())  # what libraries log
            cache.open()
            checkpoints.open_for_saving()
            writer = stack.enter_context(metrics_lib.MetricsWriter(
                self.workdir, enabled=self.is_primary, total_steps=t.steps, config=config))
            signals = stack.enter_context(StopSignals())
            state, window = self.start_state(restored, own, base)
            window.first_line.update(step_memory_gib=memory.total / GIB,
                                     step_memory_arguments_gib=memory.arguments / GIB,
                                     step_memory_temporaries_gib=memory.temporaries / GIB)
            # Closed however the loop ends (the last step, a stop signal, an error): the trace of
            # a window cut short is still written.
            profile = stack.enter_context(contextlib.closing(ProfileWindow(config.profile,
                                                                           self.workdir)))
            samples = (TrainingSamples(config, program.model.graphdef, program.mesh,
                                       program.rules) if t.sample_every else None)
            loop = _Loop(self, train_step, checkpoints, train_input, held_out, samples, window,
                         writer, signals, profile)
            return loop.run(state)

    def restore(self, checkpoints: Checkpoints, train_input: Input
                ) -> tuple[Restored | None, Restored | None, tuple[Any, str] | None]:
        """(this run's newest good checkpoint, what the run starts from, LoRA's base and its
        name): the own checkpoint, else `checkpoint.restore_from`, else None. With LoRA,
        restore_from is the frozen base instead (`lora_base`: every start reads it, no
        checkpoint holds it), and a run starts from its own checkpoint or fresh adapters. The
        data position is restored into `train_input`. Reads only: a checkpoint that does not fit
        raises before anything is written."""
        c, abstract = self.config.checkpoint, self.program.abstract_state
        model = self.program.model
        own = checkpoints.restore_newest(abstract)
        restored, base = own, None
        if model.config.lora:
            base = lora_base(self.config, model, abstract.frozen)
        elif own is None and c.restore_from:
            restored = restore_from(c.restore_from, abstract, params_only=c.restore_params_only,
                                    model_config=model.config)
        if restored is not None and restored.train is not None:
            train_input.set_state(restored.data_state)
        return own, restored, base

    def start_state(self, restored: Restored | None, own: Restored | None,
                    base: tuple[Any, str] | None = None) -> tuple[TrainState, StepWindow]:
        """The state the loop starts from (restored, or a fresh sharded init; with LoRA, on the
        `base` from `restore`), with the window that times the steps from here on."""
        init_state, seed = self.program.init_state, self.config.train.seed
        frozen = None
        if base is not None:
            frozen, name = base
            self.say(f"LoRA: the frozen base is {name}")
        run_clock = RunClock(self.workdir, enabled=self.is_primary)
        if restored is None:
            state = init_state(seed)
            if frozen is not None:
                state = state._replace(frozen=frozen)
            return state, StepWindow(self.speed, run_clock, self.start_time,
                                     restarts=run_clock.restarts)
        self.say(f"restored {restored.path} in {restored.seconds:.1f}s"
                 f"{' (params only)' if restored.train is None else ''}")
        # Another run's productive time is not this run's.
        window = StepWindow(self.speed, run_clock, self.start_time, restarts=run_clock.restarts,
                            restore_seconds=restored.seconds,
                            productive_seconds=own.meta["productive_seconds"] if own else 0.0)
        if restored.train is None:  # fine-tuning: fresh optimizer from step 0, data from the start
            return init_state(seed)._replace(params=restored.params), window
        # With LoRA, the adapters go back onto the base they were trained on.
        return TrainState(params=restored.params, frozen=frozen, **restored.train), window

    def evaluate(self, params, held_out: HeldOut) -> dict[str, float]:
        """Loss and perplexity over `train.eval_batches` batches of the held-out split."""
        total, tokens = 0.0, 0.0
        for batch in held_out.first_batches(self.config.train.eval_batches):
            batch_loss, batch_tokens = self.program.eval_step(params, batch)
            total, tokens = total + batch_loss, tokens + batch_tokens
        loss = float(total / max(float(tokens), 1.0))
        return {"loss": loss, "perplexity": float(np.exp(loss))}


class HeldOut:
    """The eval split, opened once per run: every eval reads the same first batches, without
    listing the files or loading the tokenizer again."""

    def __init__(self, config: ml_collections.ConfigDict, sharding: jax.sharding.Sharding):
        self._input = make_input(config, "eval", sharding)
        self._start = self._input.get_state()

    def first_batches(self, count: int):
        self._input.set_state(self._start)
        for _ in range(count):
            yield next(self._input)

    def close(self) -> None:
        self._input.close()


class StepsInFlight:
    """Keeps the host at most `limit` steps ahead of the devices, by waiting (not fetching) for
    older steps to finish. Without it the host can queue a whole logging window of steps, and a
    preemption signal would then wait for all of them: the save's grace period runs out."""

    def __init__(self, limit: int):
        self.limit = limit
        self._markers: collections.deque = collections.deque()

    def add(self, marker: jax.Array) -> None:
        """`marker`: any output of the step just dispatched."""
        self._markers.append(marker)
        while len(self._markers) > self.limit:
            self._markers.popleft().block_until_ready()


class _Loop:
    """One start of a run, from its first step to `train.steps` (or a stop): next batch -> train
    step -> stop check -> checkpoint when due -> metrics on logging steps -> eval on eval steps."""

    def __init__(self, trainer: Trainer, train_step, checkpoints: Checkpoints,
                 train_input: Input, held_out: HeldOut | None, samples: TrainingSamples | None,
                 window: StepWindow, writer: metrics_lib.MetricsWriter, signals: StopSignals,
                 profile: ProfileWindow):
        self.trainer, self.t = trainer, trainer.config.train
        self.train_step, self.profile = train_step, profile
        self.checkpoints, self.train_input, self.held_out = checkpoints, train_input, held_out
        self.samples = samples
        self.window, self.writer, self.signals = window, writer, signals
        self.bad_steps = BadSteps(self.t.max_bad_steps)
        self.last_saved: int | None = None
        self.in_flight = StepsInFlight(limit=2)
        # Tests make one host slow with JAXSCALE_TEST_SLOW_HOST=<process>:<seconds per step>.
        process, _, seconds = os.environ.get("JAXSCALE_TEST_SLOW_HOST", "").partition(":")
        self.test_slow_host_s = float(seconds) if process == str(jax.process_index()) else 0.0

    def is_log_step(self, step: int) -> bool:
        return step % self.t.log_every == 0 or step == self.t.steps

    def is_eval_step(self, step: int) -> bool:
        return bool(self.t.eval_every) and (step % self.t.eval_every == 0 or step == self.t.steps)

    def run(self, state: TrainState) -> dict[str, float]:
        """Trains from `state` to `train.steps`; returns the last logged metrics."""
        trainer, t, window = self.trainer, self.t, self.window
        logged: dict[str, float] = {}
        first_step = int(state.step)
        for step in range(first_step, t.steps):
            if self.test_slow_host_s:
                time.sleep(self.test_slow_host_s)
            with window.waiting_for_data():
                batch = next(self.train_input)
            # Waiting on the devices is not the host's own time: in the dispatch (which blocks on
            # some backends, e.g. for cross-process collectives on CPU) and for older steps.
            with window.waiting_for_devices(), self.profile.annotate(step):
                state, step_metrics = self.train_step(state, batch)
            done = step + 1
            window.add(step_metrics)
            with window.waiting_for_devices():
                self.in_flight.add(step_metrics["loss"])
                self.profile.step_done(step, step_metrics)
            self.bad_steps.add(done, step_metrics["skipped"])
            if stop := self.signals.reached(done):
                self.stop(stop, done, state)
            if tier := self.checkpoints.due(done, log_step=self.is_log_step(done),
                                            final=done == t.steps):
                if self.save(done, state, tier) and tier == PERSISTENT:
                    self.last_saved = done
            if self.is_log_step(done):
                with window.waiting_for_devices():
                    self.bad_steps.settle()  # raises TooManyBadSteps
                logged = {**window.summary(), **self.checkpoints.take_metrics(),
                          "data_skipped_records": self.train_input.skipped_records(),
                          **memory_metrics(trainer.local_devices)}
                hosts, warning = compare_hosts(logged, t.straggler_ratio)
                logged.update(hosts)
                if warning:
                    trainer.say(warning)
                self.writer.write(done, logged)
            if self.is_eval_step(done):
                with window.paused():
                    eval_metrics = trainer.evaluate(state.model_params(), self.held_out)
                self.writer.write(done, eval_metrics, prefix="eval_")
                logged.update({f"eval_{k}": v for k, v in eval_metrics.items()})
            if self.samples and done % t.sample_every == 0:
                with window.paused():
                    continuations = self.samples(state.model_params())
                self.writer.write_samples(done, continuations)
            self.writer.progress(done)
        self.checkpoints.wait()
        final_save = self.checkpoints.take_metrics()  # the last save's total time, known only now
        if final_save:
            self.writer.write(t.steps, final_save)
        trainer.say(self.summary_line(first_step, logged))
        return logged

    def save(self, step: int, state: TrainState, tier: str) -> bool:
        """Starts an async checkpoint of `step` to `tier`, unless it was not finite (see
        Checkpoints.save)."""
        finite, meta = self.checkpoint_of(step)
        with self.window.paused():
            return self.checkpoints.save(step, state, self.train_input.get_state(), meta,
                                         finite=finite, tier=tier)

    def checkpoint_of(self, step: int) -> tuple[bool, dict]:
        """(whether `step` and those before it were finite, the `meta` item of its checkpoint)."""
        with self.window.waiting_for_devices():  # waits for the step: its time is step time
            finite = self.bad_steps.settle() == 0
        with self.window.paused():
            config = self.trainer.config
            meta = dict(step=step, seed=config.train.seed,
                        productive_seconds=self.window.productive_seconds(),
                        config=json.loads(config.to_json_best_effort()))
            if config.model.lora.rank:  # what the adapters were trained on: they need it back
                meta["lora_base"] = (config.checkpoint.restore_from
                                     or f"the init of train.seed={config.train.seed}")
        return finite, meta

    def stop(self, stop: type[RunStopped], step: int, state: TrainState) -> None:
        """Preempted or interrupted: save `step` (every process agreed on it) to the fastest
        tier, wait until the checkpoint is durable, log the steps since the last log line and
        raise `stop`."""
        saved = None
        if self.checkpoints.enabled:
            finite, meta = self.checkpoint_of(step)
            with self.window.paused():
                saved = self.checkpoints.save_to_stop(step, state, self.train_input.get_state(),
                                                      meta, finite=finite)
        self.writer.write(step, {**self.window.summary(), **self.checkpoints.take_metrics()})
        where = f"checkpoint {saved} saved" if saved else "no checkpoint saved"
        if stop is Preempted:
            message = f"preempted at step {step}: {where}; exiting to be restarted"
        else:
            message = (f"interrupted at step {step}: {where}; run the same command again to "
                       "resume")
        self.trainer.say(message)
        raise stop(message, step)

    def summary_line(self, first_step: int, logged: dict) -> str:
        t = self.t
        steps = t.steps - first_step
        minutes, seconds = divmod(time.perf_counter() - self.trainer.start_time, 60)
        parts = [f"done: step {t.steps}, {steps} steps ({int(self.window.tokens):,} tokens) in "
                 f"{int(minutes)}m{seconds:04.1f}s"]
        if "loss" in logged:
            parts.append(f"loss {logged['loss']:.4g}")
        if "eval_loss" in logged:
            parts.append(f"eval loss {logged['eval_loss']:.4g}")
        if not self.checkpoints.enabled:
            parts.append("no checkpoint (checkpoint.enabled=False)")
        elif self.last_saved == t.steps:
            parts.append(f"checkpoint {self.checkpoints.directory / str(t.steps)}")
        else:  # the last step was not finite: no checkpoint follows a non-finite step
            parts.append(f"no checkpoint of the last step (not finite); the newest is from step "
                         f"{self.last_saved or 'none this start'}")
        return "; ".join(parts)


