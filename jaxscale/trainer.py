"""Training, readable top to bottom: config -> mesh -> model -> shardings -> state -> step -> loop.

`Trainer(config, workdir)` checks the config for the devices, builds the mesh and the training
program on it (jaxscale/training/program.py: model, optimizer, shardings, the jitted steps;
nothing compiled yet). `run()` then, a method a step:

  1. `open_inputs`: opens the inputs and checks the data (and the eval split);
  2. `check_folders`: checks that the trackers can be opened (an MLflow or W&B server answers
     in seconds) and that the checkpoint and compilation-cache folders can be written;
  3. `restore`: restores, read-only, this run's newest good checkpoint, else
     `checkpoint.restore_from` (a checkpoint that does not fit the config stops here);
  4. `compile`: compiles the train step once, ahead of time, and prints its memory per device
     next to the device's capacity: a step that does not fit stops here (the memory is also
     logged on the first metrics line); the start-up line then says how long the rendezvous,
     the restore and the compile took, and whether the step came from the compilation cache;
  5. `open_for_writing`: writes the workdir's config.json and run.json, moves the compilation
     cache in and opens the checkpoints for saving;
  6. `train`: starts from the restored state or a fresh sharded init, and runs `_Loop`: next
     batch -> train step -> stop signal? -> checkpoint when due -> metrics on logging steps ->
     eval. A `profile` window traces chosen steps (jaxscale/observe/profiling.py).

Steps 1 to 4 write nothing, and every process reaches the same verdict on them
(jaxscale/runtime/agreement.py). Nothing is fetched from the devices on steps that neither log
nor save; the host stays at most two steps ahead of the devices, so a stop signal is acted on
within two steps.
"""

from __future__ import annotations

import collections
import contextlib
import json
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np

from jaxscale.checkpoint import PERSISTENT, Checkpoints, Restored, lora_base, restore_from
from jaxscale.checkpoint.signals import Preempted, RunStopped, StopSignals
from jaxscale.checks import checked_mesh
from jaxscale.data import HeldOut, Input, check_splits, make_input
from jaxscale.errors import ConfigError
from jaxscale.inference.samples import TrainingSamples
from jaxscale.observe import metrics as metrics_lib
from jaxscale.observe import run_log
from jaxscale.observe.device_memory import (
    StepMemory,
    check_fits,
    device_capacity,
    memory_line,
    memory_metrics,
)
from jaxscale.observe.profiling import ProfileWindow
from jaxscale.observe.timing import RunClock, Speed, StepWindow, compare_hosts, read_run_record
from jaxscale.observe.trackers import check_tracker_access
from jaxscale.runtime.agreement import agreed_checks, everyone
from jaxscale.runtime.chips import GIB, peak_flops_per_device
from jaxscale.runtime.compilation_cache import (
    CACHE_FIX,
    CompilationCache,
    compilation_cache_dir,
    programs_loaded,
)
from jaxscale.runtime.distributed import lost_peer_exits_at_once
from jaxscale.runtime.workdir import (
    check_workdir,
    check_writable,
    latest_metrics,
    open_workdir,
    set_aside_earlier_start,
)
from jaxscale.training.bad_steps import BadSteps
from jaxscale.training.program import TrainProgram
from jaxscale.training.state import TrainState


def devices_kind(mesh) -> str:
    return mesh.devices.flat[0].device_kind


class Inputs(NamedTuple):
    """The run's inputs, opened and checked (`Trainer.open_inputs`)."""
    train: Input
    held_out: HeldOut | None  # the eval split; None without periodic eval


class LoraBase(NamedTuple):
    """LoRA's frozen base (`lora_base`): its parameters, laid out as the state's `frozen`, and
    what they are (a folder, a run, the init of a seed)."""
    params: Any
    name: str


class Start(NamedTuple):
    """Where this start of the run begins (`Trainer.restore`; nothing written)."""
    own: Restored | None  # this run's newest good checkpoint
    restored: Restored | None  # what the run starts from: `own`, else checkpoint.restore_from's
    base: LoraBase | None  # with LoRA, the frozen base the adapters train on; else None


class CompiledStep(NamedTuple):
    """The train step compiled for the devices, with what it needs per device and the capacity
    it was checked against (`Trainer.compile`)."""
    step: jax.stages.Compiled
    memory: StepMemory
    capacity: tuple[int, str] | None


class Trainer:
    """Trains `config` in `workdir`: `Trainer(config, workdir).run()`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices=None,
                 planned_step: tuple[jax.stages.Compiled, StepMemory] | None = None,
                 rendezvous_seconds: float | None = None):
        """`planned_step`: with mesh.auto, the planner's compiled train step for `config` (the
        layout it chose, jaxscale.plan.auto.planned_config), which the trainer runs instead of
        compiling its own. `rendezvous_seconds`: how long the processes took to find each other
        (jax.distributed), said on the start-up line."""
        self.start_time = time.perf_counter()
        self.rendezvous_seconds = rendezvous_seconds
        devices = list(devices if devices is not None else jax.devices())
        if config.mesh.auto and planned_step is None:
            raise ConfigError("mesh.auto=True is resolved before the trainer is built: "
                              "`python -m jaxscale.train` plans it; in Python, call "
                              "jaxscale.plan.auto.planned_config(config, devices) and pass its "
                              "config and step to Trainer(config, workdir, planned_step=step)")
        self._planned_step = planned_step
        mesh = checked_mesh(config, devices)
        self.workdir = workdir
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

    def say(self, message: str) -> None:
        if self.is_primary:
            print(message, flush=True)

    def run(self) -> dict[str, float]:
        """Trains to `train.steps`, resuming from the newest checkpoint; returns the newest logged
        metrics. On SIGTERM (Ctrl-C) saves and raises `Preempted` (`Interrupted`).

        The start is checked whole before anything is written (steps 1 to 4), every process
        reaching the same verdict (`agreed_checks`): a check that fails on one host stops them
        all, with its error. Only then does the run write (steps 5 and 6)."""
        # A lost peer exits before the stack closes the checkpoints (distributed.py says why).
        with contextlib.ExitStack() as stack, lost_peer_exits_at_once():
            with agreed_checks():  # each process's own checks: no collective in this block
                inputs = self.open_inputs(stack)  # 1
                checkpoints, cache_dir = self.check_folders(stack)  # 2
            # The restore is collective (every process reads its shards); nothing after it here
            # is, so a process whose check fails skips the rest and goes to the agreement.
            with agreed_checks():
                began = time.perf_counter()
                start = self.restore(checkpoints, inputs.train)  # 3
                if self.already_complete(start):
                    return latest_metrics(self.workdir)  # once every process agrees
                restored = time.perf_counter()
                cache = stack.enter_context(contextlib.closing(
                    CompilationCache(cache_dir, jax.process_index())))
                loaded = programs_loaded()
                compiled = self.compile()  # 4
                compiled_at = time.perf_counter()
            self.say(self.startup_line(restore=restored - began, compile=compiled_at - restored,
                                       loaded=everyone(programs_loaded() > loaded)))
            self.open_for_writing(start, cache, checkpoints)  # 5
            return self.train(stack, start, compiled, inputs, checkpoints)  # 6

    def startup_line(self, *, restore: float, compile: float, loaded: np.ndarray) -> str:
        """How long each phase of this start took, for a restart's cost to be seen: the
        rendezvous of the processes, the restore (the checkpoint read, or nothing found) and the
        train step's compile, with whether each process (`loaded`, in process order) loaded its
        programs from the compilation cache (a restart onto a process count seen before: the
        cache holds a step for each) or compiled them."""
        phases = ([f"rendezvous {self.rendezvous_seconds:.1f}s"]
                  if self.rendezvous_seconds is not None else [])
        phases += [f"restore {restore:.1f}s", f"compile {compile:.1f}s"]
        if self._planned_step is not None:
            how = "the planner's, compiled before"
        elif loaded.all():
            how = "loaded from the compilation cache"
        elif loaded.any():
            how = (f"loaded from the compilation cache by {int(loaded.sum())} of {loaded.size} "
                   "processes, compiled by the others")
        else:
            how = "compiled"
        return f"start-up: {', '.join(phases)} (train step {how})"

    def open_inputs(self, stack: contextlib.ExitStack) -> Inputs:
        """1. The train split's input, and the eval split's when the run evaluates, checked."""
        config = self.config
        train = stack.enter_context(contextlib.closing(
            make_input(config, "train", self.program.batch_sharding)))
        held_out = None
        if config.train.eval_every:
            check_splits(config, ("eval",))
            held_out = stack.enter_context(contextlib.closing(
                HeldOut(config, self.program.batch_sharding)))
        return Inputs(train, held_out)

    def check_folders(self, stack: contextlib.ExitStack) -> tuple[Checkpoints, str | None]:
        """2. The trackers can be opened (an MLflow or W&B server answers in seconds), and the
        checkpoint and compilation-cache folders can be written: (the checkpoints, the cache's
        folder; None: no cache)."""
        if self.is_primary:  # the one process that writes metrics
            check_tracker_access(self.config, self.workdir)
            # Read again by the RunClock once the run writes; a bad one is refused before that.
            read_run_record(self.workdir)
        checkpoints = stack.enter_context(Checkpoints(self.config, self.workdir))
        checkpoints.check_writable()
        cache_dir = compilation_cache_dir(self.config, self.workdir)
        if cache_dir:
            check_writable(cache_dir, "checkpoint.compilation_cache_dir", CACHE_FIX)
        return checkpoints, cache_dir

    def restore(self, checkpoints: Checkpoints, train_input: Input) -> Start:
        """3. Where the run starts: its own newest good checkpoint, else
        `checkpoint.restore_from`, else nothing (a fresh init). With LoRA, restore_from is the
        frozen base instead (`lora_base`: every start reads it, no checkpoint holds it), and a
        run starts from its own checkpoint or fresh adapters. The data position is restored into
        `train_input`. Reads only: a checkpoint that does not fit raises before anything is
        written."""
        c, abstract = self.config.checkpoint, self.program.abstract_state
        model = self.program.model
        own = checkpoints.restore_newest(abstract)
        restored, base = own, None
        if model.config.lora:
            base = LoraBase(*lora_base(self.config, model, abstract.frozen))
        elif own is None and c.restore_from:
            restored = restore_from(c.restore_from, abstract, params_only=c.restore_params_only,
                                    model_config=model.config)
        if restored is not None and restored.train is not None:
            train_input.set_state(restored.data_state)
        return Start(own, restored, base)

    def already_complete(self, start: Start) -> bool:
        """Whether the run's own checkpoint is at train.steps already (it says so); ConfigError
        when checkpoint.restore_from's is (a fresh run would train nothing)."""
        t, own, restored = self.config.train, start.own, start.restored
        if own is not None and own.meta["step"] >= t.steps:
            self.say(f"the run in {self.workdir} is already complete at step {own.meta['step']} "
                     f"(train.steps={t.steps}); to train it further, pass "
                     f"--config.train.steps=<more than {own.meta['step']}>")
            return True
        if own is None and restored is not None and restored.train is not None \
                and restored.meta["step"] >= t.steps:
            raise ConfigError(
                f"checkpoint.restore_from={self.config.checkpoint.restore_from!r} is at step "
                f"{restored.meta['step']}, not before train.steps={t.steps}; raise train.steps, "
                "or start from its parameters only with checkpoint.restore_params_only=True")
        return False

    def compile(self) -> CompiledStep:
        """4. The train step compiled once, ahead of time (`compile_train_step`), and its memory
        per device checked against the device's capacity (said next to it; the first metrics
        line logs it too): ConfigError when it does not fit."""
        program = self.program
        self.say(f"jaxscale: {program.model.num_params / 1e6:.2f}M parameters, mesh "
                 f"{dict(program.mesh.shape)} on {program.mesh.size} "
                 f"{devices_kind(program.mesh)} device(s), {jax.process_count()} process(es)")
        if pipeline := program.pipeline:
            self.say(pipeline.summary())
        capacity = device_capacity(self.local_devices, self.config.performance.device_memory_gib)
        step, memory = self.compile_train_step(capacity)
        self.say(f"train step: {self.program.settings.label()}")
        self.say(memory_line(memory, capacity))
        check_fits(memory, capacity)
        return CompiledStep(step, memory, capacity)

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

    def open_for_writing(self, start: Start, cache: CompilationCache,
                         checkpoints: Checkpoints) -> None:
        """5. Every check has passed: the workdir's config.json and run.json are written (an
        earlier start's metrics without a checkpoint set aside), the compilation cache moves in
        and the checkpoints may be saved."""
        if self.is_primary:
            open_workdir(self.workdir, self.config.to_json_best_effort(indent=2))
            earlier = set_aside_earlier_start(self.workdir) if start.own is None else None
            set_aside = f" (the earlier files are in {earlier})" if earlier else ""
            if checkpoints.unused_local:
                begins = (f"starting from {start.restored.path}" if start.restored
                          else "starting from step 0")
                self.say(f"{checkpoints.unused_local}; {begins}{set_aside}")
            elif earlier:
                self.say(f"{self.workdir} has metrics of an earlier start but no checkpoint to "
                         f"resume from; starting from step 0{set_aside}")
        run_log.open_file(self.workdir, jax.process_index())  # what libraries log
        cache.open()
        checkpoints.open_for_saving()

    def train(self, stack: contextlib.ExitStack, start: Start, compiled: CompiledStep,
              inputs: Inputs, checkpoints: Checkpoints) -> dict[str, float]:
        """6. From the restored state or a fresh sharded init, `_Loop` to train.steps: next batch
        -> train step -> stop signal? -> checkpoint when due -> metrics on logging steps -> eval.
        A `profile` window traces chosen steps (jaxscale/observe/profiling.py)."""
        config, program, memory = self.config, self.program, compiled.memory
        writer = stack.enter_context(metrics_lib.MetricsWriter(
            self.workdir, enabled=self.is_primary, total_steps=config.train.steps,
            config=config))
        signals = stack.enter_context(StopSignals())
        state, window = self.start_state(start)
        window.first_line.update(step_memory_gib=memory.total / GIB,
                                 step_memory_arguments_gib=memory.arguments / GIB,
                                 step_memory_temporaries_gib=memory.temporaries / GIB)
        # Closed however the loop ends (the last step, a stop signal, an error): the trace of a
        # window cut short is still written.
        profile = stack.enter_context(contextlib.closing(ProfileWindow(config.profile,
                                                                       self.workdir)))
        samples = (TrainingSamples(config, program.model.graphdef, program.mesh, program.rules)
                   if config.train.sample_every else None)
        loop = _Loop(self, compiled.step, checkpoints, inputs.train, inputs.held_out, samples,
                     window, writer, signals, profile)
        return loop.run(state)

    def start_state(self, start: Start) -> tuple[TrainState, StepWindow]:
        """The state the loop starts from (restored, or a fresh sharded init; with LoRA, on the
        base), with the window that times the steps from here on."""
        init_state, seed = self.program.init_state, self.config.train.seed
        own, restored, base = start
        frozen = None
        if base is not None:
            frozen = base.params
            self.say(f"LoRA: the frozen base is {base.name}")
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


