"""The training loop, readable top to bottom.

`Trainer(config, workdir)` validates the config and builds everything that needs no compilation
(mesh, shardings, optimizer). `run()` restores the newest checkpoint or creates the sharded state,
then loops: next batch -> train step -> preemption check -> async checkpoint when due -> metrics on
logging steps -> eval on eval steps. Nothing is fetched from the devices on steps that neither log
nor save, so the host keeps running ahead of the accelerators.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import time

import jax
import ml_collections
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from jaxscale import metrics as metrics_lib
from jaxscale.bad_steps import BadSteps
from jaxscale.checkpoint import Checkpoints, Restored, restore_from
from jaxscale.config import validate
from jaxscale.data import Input, check_splits, make_input
from jaxscale.data.sources import skipped_records
from jaxscale.goodput import RunClock
from jaxscale.mesh import build_mesh, dcn_granules
from jaxscale.optim import make_optimizer
from jaxscale.preemption import Preempted, RunStopped, StopSignals
from jaxscale.sharding import batch_sharding, rules_from_config, use_rules
from jaxscale.step import BATCH_KEYS, make_eval_step, make_train_step
from jaxscale.train_state import TrainState, init_state, model_spec, state_shardings
from jaxscale.workdir import (check_workdir, latest_metrics, open_workdir,
                              set_aside_earlier_start)


def use_compilation_cache(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Points JAX's persistent compilation cache at this run's folder (or turns it off): a restarted
    run loads its compiled programs instead of compiling them again."""
    c = config.checkpoint
    cache_dir = None
    if c.compilation_cache:
        cache_dir = c.compilation_cache_dir or os.path.join(workdir, "compilation_cache")
    compilation_cache.set_cache_dir(cache_dir)
    # JAX opens the cache once per process; reopen it in case an earlier run here used another.
    compilation_cache.reset_cache()


def devices_kind(mesh) -> str:
    return mesh.devices.flat[0].device_kind


class Trainer:
    """Trains `config` in `workdir`: `Trainer(config, workdir).run()`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, devices=None):
        self.start_time = time.perf_counter()
        devices = list(devices if devices is not None else jax.devices())
        validate(config, len(devices), dcn_granules(config.mesh, devices))
        self.config, self.workdir = config, workdir
        self.is_primary = jax.process_index() == 0
        check_workdir(workdir)

        self.mesh = build_mesh(config.mesh, devices)
        self.rules = rules_from_config(config.sharding.rules)
        self.model = model_spec(config)
        self.tx, self.schedule = make_optimizer(config.optim, config.train.steps,
                                                self.model.logical_specs)

        init = functools.partial(init_state, config, self.tx)
        abstract_state = jax.eval_shape(init, 0)
        self.state_shardings = state_shardings(abstract_state, self.model, self.tx, self.mesh,
                                               self.rules)
        # What a checkpoint is restored into: this run's shapes and shardings, whatever the mesh
        # that wrote it.
        self.abstract_state = jax.tree.map(
            lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
            abstract_state, self.state_shardings)
        self.batch_sharding = batch_sharding(self.mesh, self.rules)
        batch_shardings = {k: self.batch_sharding for k in BATCH_KEYS}
        self.init_state = jax.jit(init, out_shardings=self.state_shardings)
        self.train_step = jax.jit(
            self._with_rules(make_train_step(config, self.model.graphdef, self.tx,
                                             self.schedule)),
            in_shardings=(self.state_shardings, batch_shardings),
            out_shardings=(self.state_shardings, None), donate_argnums=0)
        self.eval_step = jax.jit(
            self._with_rules(make_eval_step(self.model.graphdef)),
            in_shardings=(self.state_shardings.params, batch_shardings))

        m, t = config.model, config.train
        # The input embedding is a lookup, not a matmul, unless it doubles as the output head.
        embedding = self.model.abstract_params["embed"].size
        matmul_params = self.model.num_params - (0 if m.tie_embeddings else embedding)
        self.flops_per_token = metrics_lib.flops_per_token(
            num_params=matmul_params, n_layers=m.n_layers, n_heads=m.n_heads,
            head_dim=m.head_dim, seq_len=t.seq_len)
        self.peak_flops = metrics_lib.peak_flops_per_device(devices_kind(self.mesh))

    def _with_rules(self, fn):
        """Traces `fn` with this run's mesh and rules active, so the model's `constrain` works."""
        @functools.wraps(fn)
        def wrapped(*args):
            with use_rules(self.mesh, self.rules):
                return fn(*args)
        return wrapped

    def say(self, message: str) -> None:
        if self.is_primary:
            print(message, flush=True)

    def run(self) -> dict[str, float]:
        """Trains to `train.steps`, resuming from the newest checkpoint; returns the newest logged
        metrics. On SIGTERM (Ctrl-C) saves and raises `Preempted` (`Interrupted`).

        The start is checked whole before anything is written: the data, the eval split, the
        checkpoint folder and whether the checkpoint to resume from fits this config. Only then
        are the workdir's files, the compilation cache and the checkpoint manager opened.
        """
        config, t = self.config, self.config.train
        with contextlib.ExitStack() as stack:
            train_input = stack.enter_context(
                contextlib.closing(make_input(config, "train", self.batch_sharding)))
            if t.eval_every:
                check_splits(config, ("eval",))
            checkpoints = stack.enter_context(Checkpoints(config, self.workdir))
            checkpoints.check_writable()
            own, restored = self.restore(checkpoints, train_input)
            if own is not None and own.meta["step"] >= t.steps:
                self.say(f"the run in {self.workdir} is already complete at step "
                         f"{own.meta['step']} (train.steps={t.steps}); to train it further, pass "
                         f"--config.train.steps=<more than {own.meta['step']}>")
                return latest_metrics(self.workdir)

            # Every check has passed: from here on the run writes.
            self.say(f"jaxscale: {self.model.num_params / 1e6:.2f}M parameters, mesh "
                     f"{dict(self.mesh.shape)} on {self.mesh.size} {devices_kind(self.mesh)} "
                     f"device(s), {jax.process_count()} process(es)")
            if self.is_primary:
                open_workdir(self.workdir, config.to_json_best_effort(indent=2))
                if own is None and (earlier := set_aside_earlier_start(self.workdir)):
                    self.say(f"{self.workdir} has metrics of an earlier start but no checkpoint "
                             f"to resume from; starting from step 0 (the earlier files are in "
                             f"{earlier})")
            use_compilation_cache(config, self.workdir)
            checkpoints.open_for_saving()
            writer = stack.enter_context(metrics_lib.MetricsWriter(
                self.workdir, enabled=self.is_primary, total_steps=t.steps))
            signals = stack.enter_context(StopSignals())
            state, window = self.start_state(restored, own)
            run = _Run(checkpoints, train_input, window, BadSteps(t.max_bad_steps), writer)
            in_flight = StepsInFlight(limit=2)
            logged: dict[str, float] = {}
            first_step = int(state.step)
            for step in range(first_step, t.steps):
                with window.waiting_for_data():
                    batch = next(train_input)
                state, step_metrics = self.train_step(state, batch)
                done = step + 1
                window.add(step_metrics)
                in_flight.add(step_metrics["loss"])
                run.bad_steps.add(done, step_metrics["skipped"])
                if stop := signals.reached(done):
                    self.stop(stop, done, state, run)
                if checkpoints.due(done, log_step=self.logs(done)) or done == t.steps:
                    self.save(done, state, run)
                if self.logs(done):
                    run.bad_steps.in_a_row()  # raises TooManyBadSteps
                    logged = {**window.summary(), **checkpoints.take_metrics(),
                              "data_skipped_records": skipped_records.count}
                    writer.write(done, logged)
                if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
                    with window.paused():
                        eval_metrics = self.evaluate(state.params)
                    writer.write(done, eval_metrics, prefix="eval_")
                    logged.update({f"eval_{k}": v for k, v in eval_metrics.items()})
                writer.progress(done)
            checkpoints.wait()
            final_save = checkpoints.take_metrics()  # the last save's total time, known only now
            if final_save:
                writer.write(t.steps, final_save)
            self.say(self.summary_line(first_step, logged, checkpoints))
        return logged

    def summary_line(self, first_step: int, logged: dict, checkpoints: Checkpoints) -> str:
        t = self.config.train
        steps = t.steps - first_step
        minutes, seconds = divmod(time.perf_counter() - self.start_time, 60)
        parts = [f"done: step {t.steps}, {steps} steps ({steps * t.batch_size * t.seq_len:,} "
                 f"tokens) in {int(minutes)}m{seconds:04.1f}s"]
        if "loss" in logged:
            parts.append(f"loss {logged['loss']:.4g}")
        if "eval_loss" in logged:
            parts.append(f"eval loss {logged['eval_loss']:.4g}")
        parts.append(f"checkpoint {checkpoints.directory / str(t.steps)}"
                     if checkpoints.enabled else "no checkpoint (checkpoint.enabled=False)")
        return "; ".join(parts)

    def logs(self, step: int) -> bool:
        t = self.config.train
        return step % t.log_every == 0 or step == t.steps

    def restore(self, checkpoints: Checkpoints,
                train_input: Input) -> tuple[Restored | None, Restored | None]:
        """(this run's newest good checkpoint, what the run starts from): the own checkpoint,
        else `checkpoint.restore_from`, else None. The data position is restored into
        `train_input`. Reads only: a checkpoint that does not fit raises before anything is
        written."""
        c = self.config.checkpoint
        own = checkpoints.restore_newest(self.abstract_state)
        restored = own
        if own is None and c.restore_from:
            restored = restore_from(c.restore_from, self.abstract_state,
                                    params_only=c.restore_params_only)
        if restored is not None and restored.train is not None:
            train_input.set_state(restored.data_state)
        return own, restored

    def start_state(self, restored: Restored | None,
                    own: Restored | None) -> tuple[TrainState, _Window]:
        """The state the loop starts from (restored, or a fresh sharded init), with the window that
        times the steps from here on."""
        seed = self.config.train.seed
        run_clock = RunClock(self.workdir, enabled=self.is_primary)
        if restored is None:
            return self.init_state(seed), _Window(self, run_clock, restarts=run_clock.restarts)
        self.say(f"restored {restored.path} in {restored.seconds:.1f}s"
                 f"{' (params only)' if restored.train is None else ''}")
        # Another run's productive time is not this run's.
        window = _Window(self, run_clock, restarts=run_clock.restarts,
                         restore_seconds=restored.seconds,
                         productive_seconds=own.meta["productive_seconds"] if own else 0.0)
        if restored.train is None:  # fine-tuning: fresh optimizer from step 0, data from the start
            return self.init_state(seed)._replace(params=restored.params), window
        return TrainState(params=restored.params, **restored.train), window

    def save(self, step: int, state: TrainState, run: _Run) -> bool:
        """Starts an async checkpoint of `step`; False when `step` was not finite, in which case the
        save moves to the next finite step, so no checkpoint follows a non-finite one."""
        if not run.checkpoints.enabled:
            return False
        if run.bad_steps.in_a_row():  # also waits for the step, so its time counts as step time
            run.checkpoints.postpone()
            self.say(f"step {step} was not finite: its checkpoint waits for a finite step")
            return False
        with run.window.paused():
            meta = dict(step=step, seed=self.config.train.seed,
                        productive_seconds=run.window.productive_seconds(),
                        config=json.loads(self.config.to_json_best_effort()))
            run.checkpoints.save(step, state, run.train_input.get_state(), meta)
        return True

    def stop(self, stop: type[RunStopped], step: int, state: TrainState, run: _Run) -> None:
        """Preempted or interrupted: save `step` (every process agreed on it), wait until the
        checkpoint is durable, log the steps since the last log line and raise `stop`."""
        saved = self.save(step, state, run)
        with run.window.paused():
            run.checkpoints.wait()
        run.writer.write(step, {**run.window.summary(), **run.checkpoints.take_metrics()})
        where = (f"checkpoint {run.checkpoints.directory / str(step)} saved" if saved
                 else "no checkpoint saved")
        if stop is Preempted:
            message = f"preempted at step {step}: {where}; exiting to be restarted"
        else:
            message = (f"interrupted at step {step}: {where}; run the same command again to "
                       "resume")
        self.say(message)
        raise stop(message, step)

    def evaluate(self, params) -> dict[str, float]:
        """Loss and perplexity over `train.eval_batches` batches of the held-out split."""
        total, tokens = 0.0, 0.0
        with contextlib.closing(make_input(self.config, "eval", self.batch_sharding)) as batches:
            for _ in range(self.config.train.eval_batches):
                batch_loss, batch_tokens = self.eval_step(params, next(batches))
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


@dataclasses.dataclass
class _Run:
    """What one `Trainer.run()` works with, besides the state."""
    checkpoints: Checkpoints
    train_input: Input
    window: _Window
    bad_steps: BadSteps
    writer: metrics_lib.MetricsWriter


class _Window:
    """The steps since the last log line: their device-side metrics and their wall time.

    Step metrics stay on the device until `summary()`, the one device->host sync per window. The
    first step of a run is timed alone (it includes compilation) and reported as
    `time_to_first_step`, with the other `first_line` metrics (restarts, restore time); throughput
    covers the later steps of the window only. Timed step time adds up to the run's productive
    time, the numerator of goodput.
    """

    def __init__(self, trainer: Trainer, run_clock: RunClock, productive_seconds: float = 0.0,
                 **first_line: float):
        self.trainer = trainer
        self.run_clock = run_clock
        self.metrics: list[dict] = []
        self.timed_steps = 0
        self.start: float | None = None  # None until the first step has finished
        self.data_wait = 0.0
        # Productive seconds of earlier processes of this run (from the checkpoint) and of the
        # windows this process has closed.
        self.productive = productive_seconds
        self.first_line = first_line  # reported on the first log line, with time_to_first_step

    @contextlib.contextmanager
    def waiting_for_data(self):
        begin = time.perf_counter()
        yield
        self.data_wait += time.perf_counter() - begin

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
            self.first_line["time_to_first_step"] = self.start - self.trainer.start_time
            self.data_wait = 0.0
        else:
            self.timed_steps += 1

    def productive_seconds(self) -> float:
        """Step time of the whole run so far: compilation, restoring, eval and checkpoint blocking
        excluded; steps an earlier process did after its last checkpoint excluded too."""
        if self.start is None:
            return self.productive
        return self.productive + time.perf_counter() - self.start

    def summary(self) -> dict[str, float]:
        fetched = jax.device_get(self.metrics)
        # Averages over the steps that counted: a skipped step's inf/NaN would hide the others.
        finite = [m for m in fetched if not m["skipped"]] or fetched
        summary = {k: float(np.mean([m[k] for m in finite])) for k in ("loss", "grad_norm")}
        summary["lr"] = float(fetched[-1]["lr"])
        summary["skipped_steps"] = int(sum(m["skipped"] for m in fetched))
        if "loss_scale" in fetched[-1]:
            summary["loss_scale"] = float(fetched[-1]["loss_scale"])
        now = time.perf_counter()
        if self.timed_steps:
            seconds = now - self.start
            t = self.trainer.config.train
            summary.update(metrics_lib.throughput(
                steps=self.timed_steps, seconds=seconds, tokens_per_step=t.batch_size * t.seq_len,
                flops_per_token=self.trainer.flops_per_token, num_devices=self.trainer.mesh.size,
                peak_flops_per_device=self.trainer.peak_flops))
            summary["data_wait_fraction"] = self.data_wait / seconds
        self.productive += now - self.start
        summary["goodput"] = self.run_clock.goodput(self.productive)
        summary.update(self.first_line)
        self.first_line = {}
        self.metrics, self.timed_steps, self.data_wait = [], 0, 0.0
        self.start = now
        return summary
