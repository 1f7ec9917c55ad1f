"""Parallelism parity: the same seed and batch give the same losses and parameters on any mesh,
and k microbatches of b sequences give the update of one batch of k*b."""

import jax
import numpy as np
import pytest

from jaxscale.parallel.sharding import with_rules
from jaxscale.training.step import summed_loss
from jaxscale.trainer import Trainer
from tests.helpers import random_batch, small_config

STEPS = 3


def train(config, tmp_path, devices=None, batches=None):
    # One batch repeated, so that the loss must fall if the steps really train.
    batches = batches or [random_batch(config)] * STEPS
    trainer = Trainer(config, str(tmp_path), devices=devices)
    state = trainer.program.init_state(config.train.seed)
    first_batch = jax.device_put(batches[0], trainer.program.batch_sharding)
    grads = jax.device_get(initial_gradients(trainer, state.params, first_batch))
    losses, grad_norms = [], []
    for i in range(STEPS):
        batch = jax.device_put(batches[i], trainer.program.batch_sharding)
        state, metrics = trainer.program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(grad_norms), jax.device_get(state.params), grads


def initial_gradients(trainer, params, batch):
    """Gradient of the mean token loss, computed under the trainer's mesh and rules."""
    program = trainer.program

    def mean_loss(p):
        total, tokens = summed_loss(program.model.graphdef, p, batch)
        return total / tokens
    return jax.jit(with_rules(jax.grad(mean_loss), program.mesh, program.rules))(params)


def assert_same_training(run, reference):
    losses, grad_norms, params, grads = run
    ref_losses, ref_grad_norms, ref_params, ref_grads = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(grad_norms, ref_grad_norms, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 grads, ref_grads)
    # Adam divides by sqrt(v), which turns float-reassociation noise on near-zero gradients into
    # differences of a fraction of one step (lr = 3e-3); 5e-5 is under 2% of a step.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5),
                 params, ref_params)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return train(small_config(), tmp_path_factory.mktemp("one"), devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh", [
    pytest.param(dict(data=8), marks=pytest.mark.slow),
    pytest.param(dict(fsdp=4, tensor=2), marks=pytest.mark.slow),
    dict(data=2, fsdp=2, tensor=2)])
def test_meshes_match_one_device(mesh, single_device, tmp_path):
    run = train(small_config(**mesh), tmp_path)
    assert_same_training(run, single_device)
    losses = run[0]
    assert losses[-1] < losses[0]  # the steps really trained


@pytest.mark.slow
def test_microbatches_match_one_big_batch(single_device, tmp_path):
    config = small_config(data=2, fsdp=2, tensor=2)
    config.train.microbatches = 2
    assert_same_training(train(config, tmp_path), single_device)


@pytest.mark.slow
def test_loss_ignores_masked_tokens(tmp_path):
    """Changing targets under a zero loss mask changes nothing."""
    config = small_config()
    batch = random_batch(config)
    altered = {k: v.copy() for k, v in batch.items()}
    altered["targets"][batch["loss_mask"] == 0] = 7
    a = train(config, tmp_path / "a", devices=jax.devices()[:1], batches=[batch] * STEPS)
    b = train(config, tmp_path / "b", devices=jax.devices()[:1], batches=[altered] * STEPS)
    np.testing.assert_array_equal(a[0], b[0])
