"""The chunked cross-entropy against the plain one, and the padded vocabulary kept out of it."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.models.spec import create_model, model_config
from jaxscale.training.loss import chunk_length, summed_cross_entropy, vocab_tiles
from jaxscale.training.step import Objective, Weights
from tests.helpers import random_batch, small_config


def test_vocab_tiles_are_the_fewest_that_divide_the_vocabulary_within_the_limit():
    assert vocab_tiles(128256, 16384) == 8  # Llama 3: 8 tiles of 16032
    assert vocab_tiles(128256, 0) == 1  # 0: the whole vocabulary
    assert vocab_tiles(32000, 16384) == 2
    assert vocab_tiles(384, 128) == 3
    assert vocab_tiles(384, 100) == 4  # 96 each: 128 is too many, 3 does not fit
    assert vocab_tiles(50, 10) == 5
    assert vocab_tiles(256, 16384) == 1


def test_chunk_length_is_the_largest_divisor_not_above_the_limit():
    assert chunk_length(2048, 1024) == 1024
    assert chunk_length(96, 64) == 48
    assert chunk_length(97, 64) == 1  # a prime length: one position at a time, still correct
    assert chunk_length(256, 1024) == 256
    assert chunk_length(256, 0) == 256


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk_len, vocab_tile", [(1, 1024), (6, 1024), (8, 1024), (6, 10),
                                                   (0, 25), (8, 7)])
def test_chunked_loss_and_gradients_equal_the_plain_ones(dtype, chunk_len, vocab_tile):
    """Scanning over sequence slices and vocabulary tiles (recomputing logits in the backward
    pass) gives the plain float32 cross-entropy of the whole [batch, length, vocab] logits, and
    the same gradients."""
    rng = np.random.default_rng(0)
    batch, length, d, vocab = 3, 24, 16, 50
    features = jnp.asarray(rng.standard_normal((batch, length, d)), dtype)
    head = jnp.asarray(rng.standard_normal((d, vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (batch, length)), jnp.int32)
    mask = jnp.asarray(rng.random((batch, length)) > 0.3, jnp.float32)

    def logits_fn(features, head, vocab_ids=None):
        return jnp.einsum("...d,dv->...v", features.astype(dtype), head.astype(dtype),
                          preferred_element_type=jnp.float32)

    def plain(features, head):  # written out here: the whole [batch, length, vocab] at once
        logits = logits_fn(features, head)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        losses = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(losses * mask)

    def chunked(features, head):
        return summed_cross_entropy(logits_fn, head, ("embed", "vocab"), features, targets,
                                    mask, chunk_len, vocab_tile)

    # A scanned path is what is tested.
    assert chunk_length(length, chunk_len) < length or vocab_tiles(vocab, vocab_tile) > 1
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
        return Objective(graphdef, chunk).summed_loss(Weights(params), batch).total

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
    total, tokens, _ = Objective(graphdef).summed_loss(Weights(params), batch)
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
        return Objective(graphdef, chunk).summed_loss(Weights(params), batch).total

    want, want_grads = jax.value_and_grad(loss)(params, 0)
    with use_rules(mesh, rules_from_config(config.sharding.rules)):
        got, got_grads = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 got_grads, want_grads)


def test_vocabulary_tiles_on_a_sharded_mesh_equal_one_device_and_skip_the_padding():
    """The model's logits (259 real ids padded to 384) in 3 strided tiles of 128 under data x
    fsdp x tensor sharding: the loss and gradients of the single-device plain loss, and the
    compiled program never holds a whole [d, vocab] head gradient before its reduction."""
    import functools

    from jaxscale.models.decoder import logits_from
    from jaxscale.parallel.mesh import build_mesh
    from jaxscale.parallel.sharding import rules_from_config, use_rules

    config = small_config()
    cfg = model_config(config)
    rng = np.random.default_rng(0)
    features = jnp.asarray(rng.standard_normal((8, 16, cfg.d_model)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((cfg.d_model, cfg.padded_vocab_size)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, cfg.vocab_size, (8, 16)), jnp.int32)
    mask = jnp.asarray(rng.random((8, 16)) > 0.3, jnp.float32)
    logits_fn = functools.partial(logits_from, cfg=cfg)

    def loss(features, head, chunk_len, vocab_tile):
        return summed_cross_entropy(logits_fn, head, ("embed", "vocab"), features, targets,
                                    mask, chunk_len, vocab_tile)

    assert vocab_tiles(cfg.padded_vocab_size, 128) == 3
    want, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(features, head, 0, 1024)
    mesh = build_mesh(dict(data=2, fsdp=2, tensor=2, pipeline=1),
                      dict(data=1, fsdp=1, tensor=1, pipeline=1), jax.devices()[:8])
    with use_rules(mesh, rules_from_config(config.sharding.rules)):
        tiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
        got, got_grads = tiled(features, head, 8, 128)
        hlo = tiled.lower(features, head, 8, 128).compile().as_text()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert float(jnp.max(jnp.abs(got_grads[1][:, cfg.vocab_size:]))) == 0.0  # padding: no grad
    # The head gradient is reduced over the data axes a tile at a time: [d, 128 / tensor], never
    # this device's whole vocabulary share [d, 384 / tensor] (what the untiled loss reduces).
    reductions = [line for line in hlo.splitlines() if " all-reduce(" in line
                  or " reduce-scatter(" in line]
    assert any(f"f32[{cfg.d_model},64]" in line for line in reductions)
    assert not any(f"f32[{cfg.d_model},192]" in line for line in reductions)


@pytest.mark.parametrize("chunk_len, vocab_tile", [(0, 0), (8, 128)])
def test_in_bfloat16_every_matmul_of_the_loss_takes_bfloat16_and_the_gradients_match_float32(
        chunk_len, vocab_tile):
    """The logits are float32, but their gradient is rounded to bfloat16 before the head's two
    backward matmuls (as autocast does; in float32 they run as TF32 on GPUs): no matmul of the
    lowered program has a float32 operand, whole or sliced and tiled, and the head's and the
    features' gradients are the float32 computation's to bfloat16's precision."""
    import functools
    import re

    from jaxscale.models.decoder import logits_from

    rng = np.random.default_rng(0)
    features = rng.standard_normal((4, 16, 64))
    head = rng.standard_normal((64, 384)) * 0.05
    targets = jnp.asarray(rng.integers(0, 259, (4, 16)), jnp.int32)
    mask = jnp.asarray(rng.random((4, 16)) > 0.2, jnp.float32)

    def gradients(dtype):
        config = small_config()
        config.precision.compute_dtype = dtype
        logits_fn = functools.partial(logits_from, cfg=model_config(config))

        def loss(features, head):
            return summed_cross_entropy(logits_fn, head, ("embed", "vocab"), features, targets,
                                        mask, chunk_len, vocab_tile)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        args = jnp.asarray(features, dtype), jnp.asarray(head, jnp.float32)
        return grad(*args), grad.lower(*args).as_text()

    (feature_grad, head_grad), program = gradients("bfloat16")
    (want_features, want_head), _ = gradients("float32")
    dots = [line for line in program.splitlines() if "dot_general" in line]
    assert len(dots) >= 3  # the logits, and the two products of their gradient
    for line in dots:
        operands = re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\)", line).groups()
        assert all(o.endswith("xbf16>") for o in operands), line
    for got, want in ((head_grad, want_head), (feature_grad, want_features)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
