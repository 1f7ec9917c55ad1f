"""A forced non-finite step (issue 23): the learning-rate schedule follows the run's steps, not
the updates applied, so skipped steps do not keep cosine from reaching min_lr; the logged `lr` is
the rate the step's update applied (0 on a skipped step); a resumed run continues the schedule
where the uninterrupted one would be.

The applied rate is read back from the parameters: Adam with b1 = b2 = 0, no weight decay and no
clipping moves each weight by lr * g / (|g| + eps), i.e. by lr wherever |g| >> eps, so the
largest move of any weight is the rate. The expected rates are the closed form of linear warmup
and cosine, written here.
"""

from __future__ import annotations

import math
import shutil

import jax
import numpy as np
import optax
import pytest

import jaxscale.trainer
from jaxscale.checkpoint import Checkpoints
from jaxscale.data import make_input
from jaxscale.trainer import Trainer
from jaxscale.training.optim import learning_rate_schedule
from tests.helpers import random_batch, small_config
from tests.test_checkpoint import read_metrics

STEPS, WARMUP, LR, MIN_RATIO = 8, 2, 0.1, 0.1
SKIPPED = (2, 5)  # step indices whose loss overflows


def overflowing(batch: dict) -> dict:
    """`batch` with weights +3e38 and -3e38 on two real tokens of row 0: they cancel in the token
    count, which stays finite as in a real divergence, while the summed loss (~5 x 3e38 each)
    becomes inf - inf = NaN. Multiplied in, so a sharded mask keeps its sharding."""
    mask = np.asarray(jax.device_get(batch["loss_mask"]))
    first, second = np.flatnonzero(mask[0])[:2]
    factor = np.ones_like(mask)
    factor[0, first], factor[0, second] = 3e38, -3e38
    return {**batch, "loss_mask": batch["loss_mask"] * factor}


class OverflowingInput:
    """The trainer's train input, serving step `step` first, with the batches of SKIPPED
    overflowing."""

    def __init__(self, inner, step: int):
        self.inner, self.step = inner, step

    def __next__(self):
        batch = next(self.inner)
        self.step += 1
        return overflowing(batch) if self.step - 1 in SKIPPED else batch

    def __getattr__(self, name):  # get_state, set_state, skipped_records, close
        return getattr(self.inner, name)


def overflow(monkeypatch, first_step: int) -> None:
    """The trainer's train input made an OverflowingInput serving `first_step` first."""
    def overflowing_input(config, split, sharding):
        inner = make_input(config, split, sharding)
        return OverflowingInput(inner, first_step) if split == "train" else inner
    monkeypatch.setattr(jaxscale.trainer, "make_input", overflowing_input)


def rate(step: int, steps: int = STEPS, warmup: int = WARMUP, lr: float = LR,
         ratio: float = MIN_RATIO) -> float:
    """The schedule's rate at `step` (0-based), by hand: 0 -> lr over `warmup` steps, then
    cosine from lr to lr * ratio at the last step, steps - 1."""
    if step < warmup:
        return lr * step / warmup
    progress = (step - warmup) / (steps - 1 - warmup)
    return lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("steps,warmup", [(2, 0), (3, 1), (10, 3), (100, 20), (1000, 0)])
def test_the_schedule_ends_at_min_lr_on_the_last_step(steps, warmup):
    optim = small_config().optim
    optim.update(lr=LR, warmup_steps=warmup, min_lr_ratio=MIN_RATIO)
    schedule = learning_rate_schedule(optim, steps)
    got = [float(schedule(s)) for s in range(steps)]
    np.testing.assert_allclose(got, [rate(s, steps, warmup) for s in range(steps)], rtol=1e-6)
    assert got[-1] == pytest.approx(LR * MIN_RATIO, rel=1e-6)


@pytest.mark.parametrize("steps,warmup", [(1, 0), (1, 5), (2, 1), (4, 20)])
def test_a_warmup_as_long_as_the_run_ends_at_the_peak(steps, warmup):
    """Warmup wins: it is cut to the run's steps but one, and with no step left to decay over the
    last step gets optim.lr (so a run of 2 steps with warmup 1 takes the first 2 steps of a longer
    run with min_lr_ratio 1, which the resume tests rely on)."""
    optim = small_config().optim
    optim.update(lr=LR, warmup_steps=warmup, min_lr_ratio=MIN_RATIO)
    schedule = learning_rate_schedule(optim, steps)
    got = [float(schedule(s)) for s in range(steps)]
    assert got == pytest.approx([LR * s / (steps - 1) for s in range(steps - 1)] + [LR], rel=1e-6)


def sign_adam_config():
    config = small_config(fsdp=8)
    config.train.update(steps=STEPS, max_bad_steps=3)
    config.optim.update(lr=LR, warmup_steps=WARMUP, min_lr_ratio=MIN_RATIO, b1=0.0, b2=0.0,
                        weight_decay=0.0, grad_clip=0.0)
    config.checkpoint.update(every_steps=4, keep=10, compilation_cache=False)
    return config


def adam_count(opt_state) -> int:
    """Adam's count: the updates its moments have taken in."""
    def is_adam(x):
        return isinstance(x, optax.ScaleByAdamState)
    (adam,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    return int(adam.count)


def test_the_logged_rate_is_the_applied_rate_and_skips_do_not_delay_the_schedule(tmp_path):
    trainer = Trainer(sign_adam_config(), str(tmp_path))
    state = trainer.program.init_state(0)
    for step in range(STEPS):
        batch = random_batch(trainer.config, seed=step)
        if step in SKIPPED:
            batch = overflowing(batch)
        before = jax.device_get((state.params, state.opt_state))
        state, metrics = trainer.program.train_step(
            state, jax.device_put(batch, trainer.program.batch_sharding))
        params, opt_state = jax.device_get((state.params, state.opt_state))
        moves = jax.tree.leaves(jax.tree.map(
            lambda new, old: np.max(np.abs(new.astype(np.float64) - old)), params, before[0]))
        applied, logged = max(moves), float(metrics["lr"])
        assert int(metrics["skipped"]) == (step in SKIPPED), step
        if step in SKIPPED:
            # Nothing applied: the weights and Adam's moments are as they were, bit for bit.
            jax.tree.map(np.testing.assert_array_equal, params, before[0])
            assert adam_count(opt_state) == adam_count(before[1])
            assert logged == 0.0
        else:
            # The rate of the step's own index: after k skips, not the rate of index step - k.
            assert applied == pytest.approx(rate(step), rel=1e-5), step
            assert logged == pytest.approx(applied, rel=1e-5), step
    # The last step (not skipped) applied min_lr, two skips notwithstanding.
    assert applied == pytest.approx(LR * MIN_RATIO, rel=1e-5)
    assert int(state.step) == STEPS
    assert adam_count(state.opt_state) == STEPS - len(SKIPPED)  # bias correction: applied only


@pytest.mark.slow  # two runs, one interrupted and resumed (about 12 s)
def test_a_resumed_run_continues_the_schedule_and_the_counts(tmp_path, monkeypatch):
    """Trained to step 8 with two skipped steps; the same run restarted from its checkpoint of
    step 4 logs the same rates and losses and ends with the same state, bit for bit."""
    config = sign_adam_config()
    overflow(monkeypatch, first_step=0)
    whole = tmp_path / "whole"
    Trainer(config, str(whole)).run()
    lines = read_metrics(whole)
    assert [l["skipped_steps"] for l in lines] == [int(s in SKIPPED) for s in range(STEPS)]
    assert [l["lr"] for l in lines] == pytest.approx(
        [0.0 if s in SKIPPED else rate(s) for s in range(STEPS)], rel=1e-6)

    resumed = tmp_path / "resumed"
    shutil.copytree(whole / "checkpoints" / "4", resumed / "checkpoints" / "4")
    overflow(monkeypatch, first_step=4)
    trainer = Trainer(config, str(resumed))
    trainer.run()
    again = read_metrics(resumed)
    assert [(l["step"], l["lr"], l["skipped_steps"]) for l in again] == [
        (l["step"], l["lr"], l["skipped_steps"]) for l in lines[4:]]
    # Equal bits, the skipped step's NaN included.
    np.testing.assert_array_equal([l["loss"] for l in again], [l["loss"] for l in lines[4:]])

    states = []
    for workdir in (whole, resumed):
        with Checkpoints(config, str(workdir)) as checkpoints:
            restored = checkpoints.restore_newest(trainer.program.abstract_state)
        states.append(jax.device_get((restored.params, restored.train)))
    (params, train), (params_again, train_again) = states
    assert int(train["step"]) == int(train_again["step"]) == STEPS
    assert adam_count(train["opt_state"]) == adam_count(train_again["opt_state"]) \
        == STEPS - len(SKIPPED)
    jax.tree.map(np.testing.assert_array_equal, (params, train), (params_again, train_again))
