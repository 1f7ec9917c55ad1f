"""Overhead of the jaxscale train step over a bare hand-written `jax.jit` step.

Both steps train the same tiny model on the same batch with the same optimizer, on one device. The
bare step is what a user would write in ten lines: value_and_grad, optax update, apply. jaxscale's
adds explicit shardings, donation, loss masking, the non-finite-step guard and metrics.

    python benchmarks/step_overhead.py [--steps=30] [--config.KEY=VALUE ...]

Prints both step times, time-to-first-step, and `ratio: X` (jaxscale / bare) last. Target <= 1.05.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxscale.config import default_config
from jaxscale.models.spec import (
    create_model,
    model_config,
)
from jaxscale.trainer import Trainer


def make_batch(config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b, l = config.train.batch_size, config.train.seq_len
    tokens = rng.integers(3, config.model.vocab_size, (b, l + 1), dtype=np.int32)
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=np.ones((b, l), np.float32),
                positions=np.broadcast_to(np.arange(l, dtype=np.int32), (b, l)).copy(),
                segment_ids=np.ones((b, l), np.int32))


def bare_step_fn(config, tx):
    graphdef, _ = nnx.split(create_model(model_config(config), 0))

    def loss_fn(params, batch):
        # The same packed-batch forward pass (positions, segment ids) and masked mean as jaxscale,
        # so the ratio measures the step's machinery, not a different model computation.
        logits = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"],
                                             batch["segment_ids"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.sum(losses * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def time_steps(run_step, steps: int) -> float:
    """Seconds per step over `steps` steps (the caller has already compiled)."""
    start = time.perf_counter()
    for _ in range(steps):
        out = run_step()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=10, help="alternating timing rounds")
    args, overrides = parser.parse_known_args()
    config = default_config()
    for override in overrides:  # --config.train.seq_len=64 style
        key, value = override.removeprefix("--config.").split("=", 1)
        group, name = key.split(".")
        config[group][name] = type(config[group][name])(value)
    config.mesh.update(data=1)
    batch_np = make_batch(config)
    device = jax.devices()[:1]

    start = time.perf_counter()
    trainer = Trainer(config, tempfile.mkdtemp(), devices=device)
    state = trainer.program.init_state(0)
    batch = jax.device_put(batch_np, trainer.program.batch_sharding)
    state, metrics = trainer.program.train_step(state, batch)
    jax.block_until_ready(metrics)
    jaxscale_first = time.perf_counter() - start

    start = time.perf_counter()
    bare = bare_step_fn(config, trainer.program.tx)
    model = create_model(model_config(config), 0)
    params = jax.device_put(nnx.to_pure_dict(nnx.split(model)[1]), device[0])
    opt_state = trainer.program.tx.init(params)
    bare_batch = jax.device_put(batch_np, device[0])
    params, opt_state, loss = bare(params, opt_state, bare_batch)
    jax.block_until_ready(loss)
    bare_first = time.perf_counter() - start

    def jaxscale_step():
        nonlocal state
        state, m = trainer.program.train_step(state, batch)
        return m

    def bare_step():
        nonlocal params, opt_state
        params, opt_state, l = bare(params, opt_state, bare_batch)
        return l

    # Alternate the two so that machine noise (other processes, clocks) hits both alike; keep the
    # best round of each, the usual estimate of a step's cost without interference.
    jaxscale_times, bare_times = [], []
    for _ in range(args.rounds):
        jaxscale_times.append(time_steps(jaxscale_step, args.steps))
        bare_times.append(time_steps(bare_step, args.steps))
    ours, theirs = min(jaxscale_times), min(bare_times)
    num_params = trainer.program.model.num_params
    print(f"device: {jax.devices()[0].device_kind}, model {num_params / 1e6:.2f}M "
          f"params, batch {config.train.batch_size}x{config.train.seq_len}, "
          f"{config.precision.compute_dtype}")
    print(f"jaxscale step: {ours * 1e3:.2f} ms  (time to first step {jaxscale_first:.1f} s)")
    print(f"bare jit step: {theirs * 1e3:.2f} ms  (time to first step {bare_first:.1f} s)")
    print(f"ratio: {ours / theirs:.3f}")


if __name__ == "__main__":
    main()
