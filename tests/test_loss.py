"""The chunked cross-entropy against the plain one, and the padded vocabulary kept out of it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.training.loss import chunk_length, summed_cross_entropy
from jaxscale.models import create_model
from jaxscale.training.state import model_config
from jaxscale.training.step import summed_loss
from flax import nnx
from tests.helpers import random_batch, small_config


def test_chunk_length_is_the_largest_divisor_not_above_the_limit():
    assert chunk_length(2048, 1024) == 1024
    assert chunk_length(96, 64) == 48
    assert chunk_length(97, 64) == 1  # a prime length: one position at a time, still correct
    assert chunk_length(256, 1024) == 256
    assert chunk_length(256, 0) == 256


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_len", [1, 6, 8])
def test_chunked_loss_and_gradients_equal_the_plain_ones(dtype, chunk_len):
    """Scanning over sequence slices (recomputing logits in the backward pass) gives the plain
    float32 cross-entropy of the whole [batch, length, vocab] logits, and the same gradients."""
    rng = np.random.default_rng(0)
    batch, length, d, vocab = 3, 24, 16, 50
    features = jnp.asarray(rng.standard_normal((batch, length, d)), dtype)
    head = jnp.asarray(rng.standard_normal((d, vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    mask = jnp.asarray(rng.random((batch, length)) > 0.3, jnp.float32)

    def logits_fn(features, head):
        return jnp.einsum("...d,dv->...v", features.astype(dtype), head.astype(dtype),
                          preferred_element_type=jnp.float32)

    def plain(features, head):  # written out here: the whole [batch, length, vocab] at once
        logits = logits_fn(features, head)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        losses = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(losses * mask)

    def chunked(features, head):
        return summed_cross_entropy(logits_fn, head, ("embed", "vocab"), features, targets,
                                    mask, chunk_len)

    assert chunk_length(length, chunk_len) < length  # the scanned path is what is tested
    want, want_grads = jax.value_and_grad(plain, argnums=(0, 1))(features, head)
    got, got_grads = jax.value_and_grad(chunked, argnums=(0, 1))(features, head)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # bfloat16 feature gradients are rounded to 8 bits of mantissa, in either order of summation.
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   **tolerance)


def test_model_loss_with_chunks_equals_without_on_packed_rows():
    """The model's summed loss (packed documents, padding masked) does not depend on the chunk."""
    config = small_config()
    config.model.tie_embeddings = True  # the head is the embedding's transpose: both gradients
    model = create_model(model_config(config), 0)
    graphdef, params = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in random_batch(config).items()}

    def loss(params, chunk):
        return summed_loss(graphdef, params, batch, chunk)[0]

    plain, plain_grads = jax.value_and_grad(loss)(params, 0)
    chunked, chunked_grads = jax.value_and_grad(loss)(params, 4)
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 chunked_grads, plain_grads)


def test_padded_vocabulary_takes_no_part_in_the_softmax():
    """With the byte tokenizer's 259 ids padded to 384 rows, the loss at init is about ln(259):
    the padding rows get no probability. (Unmasked it was ~ln(384) + 0.3 nats.)"""
    config = small_config()
    cfg = model_config(config)
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (259, 384)
    model = create_model(cfg, 0)
    graphdef, params = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in random_batch(config).items()}
    total, tokens = summed_loss(graphdef, params, batch)
    assert abs(total / tokens - math.log(259)) < 0.05, total / tokens

    logits = model(batch["inputs"])
    probabilities = jax.nn.softmax(logits, axis=-1)
    assert float(jnp.max(probabilities[..., 259:])) == 0.0
    assert float(jnp.min(jnp.sum(probabilities[..., :259], axis=-1))) > 0.999


def test_chunked_loss_on_a_sharded_mesh_equals_one_device():
    """Under data x fsdp x tensor sharding (the head gradient accumulated in the head's sharded
    layout), the chunked loss and its gradients equal the single-device plain ones."""
    from jaxscale.parallel.mesh import build_mesh
    from jaxscale.parallel.sharding import rules_from_config, use_rules

    config = small_config()
    model = create_model(model_config(config), 0)
    graphdef, params = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in random_batch(config).items()}
    mesh = build_mesh(dict(data=2, fsdp=2, tensor=2, pipeline=1),
                      dict(data=1, fsdp=1, tensor=1, pipeline=1), jax.devices()[:8])

    def loss(params, chunk):
        return summed_loss(graphdef, params, batch, chunk)[0]

    want, want_grads = jax.value_and_grad(loss)(params, 0)
    with use_rules(mesh, rules_from_config(config.sharding.rules)):
        got, got_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 got_grads, want_grads)
