"""The training loop, readable top to bottom.

`Trainer(config, workdir)` validates the config and builds everything that needs no compilation (mesh,
shardings, optimizer). `run()` creates the sharded state, then loops: next batch -> train step ->
metrics on logging steps -> eval on eval steps. Nothing is fetched from the devices on steps that do
not log, so the host keeps running ahead of the accelerators.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time

import jax
import ml_collections
import numpy as np

from jaxscale import metrics as metrics_lib
from jaxscale.config import validate
from jaxscale.data import make_input
from jaxscale.errors import ConfigError
from jaxscale.mesh import build_mesh, dcn_granules
from jaxscale.optim import make_optimizer
from jaxscale.sharding import batch_sharding, rules_from_config, use_rules
from jaxscale.step import BATCH_KEYS, make_eval_step, make_train_step
from jaxscale.train_state import init_state, model_spec, state_shardings


def prepare_workdir(workdir: str) -> None:
    """Creates `workdir` and proves it is writable, before anything is compiled."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"workdir {workdir!r} cannot be written ({e.strerror}); pass "
                          "--workdir=<a folder you can write>") from e


class Trainer:
    """Trains `config` in `workdir`: `Trainer(config, workdir).run()`."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str):
        self.start_time = time.perf_counter()
        devices = jax.devices()
        validate(config, len(devices), dcn_granules(config.mesh, devices))
        self.config, self.workdir = config, workdir
        self.is_primary = jax.process_index() == 0
        if self.is_primary:
            prepare_workdir(workdir)

        self.mesh = build_mesh(config.mesh, devices)
        self.rules = rules_from_config(config.sharding.rules)
        self.model = model_spec(config)
        self.tx, self.schedule = make_optimizer(config.optim, config.train.steps,
                                                self.model.logical_specs)

        init = functools.partial(init_state, config, self.tx)
        self.state_shardings = state_shardings(jax.eval_shape(init, 0), self.model, self.tx,
                                               self.mesh, self.rules)
        self.batch_sharding = batch_sharding(self.mesh, self.rules)
        batch_shardings = {k: self.batch_sharding for k in BATCH_KEYS}
        self._init = jax.jit(init, out_shardings=self.state_shardings)
        self._train_step = jax.jit(
            self._with_rules(make_train_step(config, self.model.graphdef, self.tx,
                                             self.schedule)),
            in_shardings=(self.state_shardings, batch_shardings),
            out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._eval_step = jax.jit(
            self._with_rules(make_eval_step(self.model.graphdef)),
            in_shardings=(self.state_shardings.params, batch_shardings))

        m, t = config.model, config.train
        matmul_params = self.model.num_params - (0 if m.tie_embeddings else
                                                 int(np.prod(self.model.abstract_params["embed"].shape)))
        self.flops_per_token = metrics_lib.flops_per_token(
            num_params=matmul_params, n_layers=m.n_layers, n_heads=m.n_heads,
            head_dim=m.head_dim, seq_len=t.seq_len)
        self.peak_flops = metrics_lib.peak_flops_per_device(devices[0].device_kind)

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
        """Trains for `train.steps` steps; returns the last logged metrics."""
        config, t = self.config, self.config.train
        self.say(f"jaxscale: {self.model.num_params / 1e6:.2f}M parameters, mesh "
                 f"{dict(self.mesh.shape)} on {jax.device_count()} {jax.devices()[0].device_kind} "
                 f"device(s), {jax.process_count()} process(es)")
        if self.is_primary:
            with open(os.path.join(self.workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2))

        state = self._init(t.seed)
        train_input = make_input(config, "train", self.batch_sharding)
        window = _Window(self)
        logged: dict[str, float] = {}
        with metrics_lib.MetricsWriter(self.workdir, enabled=self.is_primary,
                                       total_steps=t.steps) as writer:
            for step in range(int(state.step), t.steps):
                with window.waiting_for_data():
                    batch = next(train_input)
                state, step_metrics = self._train_step(state, batch)
                window.add(step_metrics)
                done = step + 1
                if done % t.log_every == 0 or done == t.steps:
                    logged = window.summary()
                    writer.write(done, logged)
                if t.eval_every and (done % t.eval_every == 0 or done == t.steps):
                    with window.paused():
                        eval_metrics = self.evaluate(state.params)
                    writer.write(done, eval_metrics, prefix="eval_")
                    logged.update({f"eval_{k}": v for k, v in eval_metrics.items()})
                writer.progress(done)
        return logged

    def evaluate(self, params) -> dict[str, float]:
        """Loss and perplexity over `train.eval_batches` batches of the held-out split."""
        eval_input = make_input(self.config, "eval", self.batch_sharding)
        total, tokens = 0.0, 0.0
        for _ in range(self.config.train.eval_batches):
            batch_loss, batch_tokens = self._eval_step(params, next(eval_input))
            total, tokens = total + batch_loss, tokens + batch_tokens
        loss = float(total / max(float(tokens), 1.0))
        return {"loss": loss, "perplexity": float(np.exp(loss))}



class _Window:
    """The steps since the last log line: their device-side metrics and their wall time.

    Step metrics stay on the device until `summary()`, the one device->host sync per window. The
    first step of a run is timed alone (it includes compilation) and reported as
    `time_to_first_step`; throughput covers the later steps of the window only.
    """

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.metrics: list[dict] = []
        self.timed_steps = 0
        self.start: float | None = None  # None until the first step has finished
        self.data_wait = 0.0
        self.time_to_first_step: float | None = None

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
            self.time_to_first_step = self.start - self.trainer.start_time
            self.data_wait = 0.0
        else:
            self.timed_steps += 1

    def summary(self) -> dict[str, float]:
        fetched = jax.device_get(self.metrics)
        summary = {k: float(np.mean([m[k] for m in fetched])) for k in ("loss", "grad_norm")}
        summary["lr"] = float(fetched[-1]["lr"])
        summary["skipped_steps"] = int(sum(m["skipped"] for m in fetched))
        if "loss_scale" in fetched[-1]:
            summary["loss_scale"] = float(fetched[-1]["loss_scale"])
        if self.timed_steps:
            seconds = time.perf_counter() - self.start
            t = self.trainer.config.train
            summary.update(metrics_lib.throughput(
                steps=self.timed_steps, seconds=seconds, tokens_per_step=t.batch_size * t.seq_len,
                flops_per_token=self.trainer.flops_per_token, num_devices=jax.device_count(),
                peak_flops_per_device=self.trainer.peak_flops))
            summary["data_wait_fraction"] = self.data_wait / seconds
        if self.time_to_first_step is not None:
            summary["time_to_first_step"] = self.time_to_first_step
            self.time_to_first_step = None
        self.metrics, self.timed_steps, self.data_wait = [], 0, 0.0
        self.start = time.perf_counter()
        return summary
