"""LoRA dropout (`model.lora.dropout`, jaxscale/models/lora.py): the train step's loss and
gradients are those of a plain-JAX model written here that drops the adapters' inputs with masks
drawn from the documented keys; evaluation and sampling never drop; every mesh and pipeline
schedule draws the masks one device draws; a step replays its own masks and the next step draws
others; dropout=0 adds nothing to the step; bad rates are ConfigErrors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxscale.config import check_schema
from jaxscale.errors import ConfigError
from jaxscale.models import lora
from jaxscale.models.spec import model_spec
from jaxscale.training.step import Objective, Weights
from tests.helpers import one_line_error, random_batch
from tests.test_lora import lora_config, program_for, with_nonzero_b

RATE = 0.25


def dropout_config(rate=RATE, **mesh):
    """16 rows in two microbatches (`split_rows` interleaves them: row r is in part r % 2), which
    the pipelines split further (into 4 microbatches of their own)."""
    schedule = mesh.pop("schedule", None)
    config = lora_config(**mesh)
    config.model.lora.dropout = rate
    config.train.update(batch_size=16, microbatches=2)
    if schedule:
        config.pipeline.schedule = schedule
    return config


def adapted_state(program, step=0):
    """The init state with nonzero B (a trained adapter's) at `step`, on the program's mesh."""
    state = jax.device_get(program.init_state(0))
    state = state._replace(params=with_nonzero_b(state.params), step=np.int32(step))
    return jax.device_put(state, program.state_shardings)


def train_step(program, step=0):
    """(loss, grad norm) of a train step at `step` from `adapted_state`, on `random_batch`."""
    batch = jax.device_put(random_batch(program.config), program.batch_sharding)
    _, metrics = program.train_step(adapted_state(program, step), batch)
    return float(metrics["loss"]), float(metrics["grad_norm"])


@pytest.fixture(scope="module")
def single():
    """The dropout run's program on one device (compiled once for the module)."""
    return program_for(dropout_config())


@pytest.fixture(scope="module")
def one_device(single):
    return train_step(single)


# -- a plain-JAX model with the masks drawn from the documented keys -------------------------

def adapter_inputs(config):
    """{"layer/target": (layer, the target's index, its input's shape without the batch)}."""
    m = config.model
    shapes = dict(o=(m.n_heads, m.head_dim), down=(m.mlp_dim,))
    return {f"{layer}/{name}": (layer, t, (config.train.seq_len, *shapes.get(name, (m.d_model,))))
            for layer in range(m.n_layers) for t, name in enumerate(lora.TARGETS)}


def documented_masks(config, step):
    """{"layer/target": keep / (1 - p)} for every adapter's input, [batch, *its shape]. Row r's
    key is train.seed and the step's, folded with r, the layer's index and the target's
    (`lora.TARGETS`), whatever the microbatches."""
    p = config.model.lora.dropout
    step_key = lora.dropout_key(config.train.seed, step)
    row_keys = [jax.random.fold_in(step_key, r) for r in range(config.train.batch_size)]
    return {name: jnp.stack([jax.random.bernoulli(
                jax.random.fold_in(jax.random.fold_in(k, layer), t), 1 - p, shape)
                for k in row_keys]) / (1 - p)
            for name, (layer, t, shape) in adapter_inputs(config).items()}


def no_masks(config):
    return {name: jnp.ones((config.train.batch_size, *shape))
            for name, (_, _, shape) in adapter_inputs(config).items()}


def reference_mean_loss(adapters, frozen, batch, masks, config):
    """The mean token loss of the small LoRA model, written out in jax.numpy; each adapter's
    (alpha / r) (x A) B takes x * masks[layer/target]."""
    m = config.model
    params = lora.join_adapters(adapters, frozen)
    scale = m.lora.alpha / m.lora.rank
    tokens, positions, segments = batch["inputs"], batch["positions"], batch["segment_ids"]

    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + m.norm_eps) * w

    def rope(x):
        half = x.shape[-1] // 2
        angle = positions[..., None, None] * m.rope_theta ** (-jnp.arange(half) / half)
        x1, x2 = x[..., :half], x[..., half:]
        return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                                x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)

    def dense(spec, x, layer, name, w):
        """x W + (alpha / r) ((x * mask) A) B."""
        a, b = (w[f"{name}_lora"][factor][layer] for factor in ("a", "b"))
        x_axes, weight_axes, out_axes = re.split(",|->", spec)
        inputs = a.ndim - 1
        low = jnp.einsum(f"{x_axes},{weight_axes[:inputs]}z->btz", x * masks[f"{layer}/{name}"],
                         a)
        return (jnp.einsum(spec, x, w[name][layer])
                + scale * jnp.einsum(f"btz,z{weight_axes[inputs:]}->{out_axes}", low, b))

    blocks = params["blocks"]
    attn, mlp = blocks["attn"], blocks["mlp"]
    x = params["embed"][tokens]
    length = tokens.shape[1]
    allowed = jnp.tril(jnp.ones((length, length), bool)) & (
        segments[:, :, None] == segments[:, None, :])
    for layer in range(m.n_layers):
        h = norm(x, blocks["attn_norm"]["scale"][layer])
        q = rope(dense("btd,dnh->btnh", h, layer, "q", attn))
        k = rope(dense("btd,dkh->btkh", h, layer, "k", attn))
        v = dense("btd,dkh->btkh", h, layer, "v", attn)
        group = m.n_heads // m.n_kv_heads
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqnh,bknh->bnqk", q, k) / np.sqrt(m.head_dim)
        probs = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
        x = x + dense("btnh,nhd->btd", jnp.einsum("bnqk,bknh->bqnh", probs, v), layer, "o", attn)
        h = norm(x, blocks["mlp_norm"]["scale"][layer])
        hidden = (jax.nn.silu(dense("btd,df->btf", h, layer, "gate", mlp))
                  * dense("btd,df->btf", h, layer, "up", mlp))
        x = x + dense("btf,fd->btd", hidden, layer, "down", mlp)
    logits = (norm(x, params["final_norm"]["scale"]) @ params["head"])[..., :m.vocab_size]
    losses = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, batch["targets"][..., None], -1)[..., 0]
    return jnp.sum(losses * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])


@pytest.fixture(scope="module")
def reference():
    """jit(value_and_grad(reference_mean_loss)) over (adapters, frozen, batch, masks)."""
    config = dropout_config()
    return jax.jit(jax.value_and_grad(
        lambda a, f, b, masks: reference_mean_loss(a, f, b, masks, config)))


@pytest.mark.slow  # the dropout step against a plain JAX model (about 20 s)
def test_the_step_is_a_plain_jax_model_with_the_documented_masks(single, reference):
    """The train step at step 3, two microbatches, gives the reference's loss and gradient
    norm; in one piece, the step's gradients are the reference's, leaf by leaf."""
    config = single.config
    state = jax.device_get(adapted_state(single, step=3))
    batch = jax.tree.map(jnp.asarray, random_batch(config))
    loss, grads = reference(state.params, state.frozen, batch, documented_masks(config, 3))
    np.testing.assert_allclose(train_step(single, step=3), (loss, optax.tree.norm(grads)),
                               rtol=1e-5)

    keys = lora.AdapterDropout.for_rows(RATE, lora.dropout_key(config.train.seed, 3),
                                        config.train.batch_size).keys
    tokens = jnp.sum(batch["loss_mask"])
    total, step_grads, _, _ = jax.jit(
        lambda a, f, b, k: Objective.of(config, single.model.train_graphdef, None)
        .forward_backward(Weights(a, f), b, 1 / tokens, lora.AdapterDropout(RATE, k))
    )(state.params, state.frozen, batch, keys)
    np.testing.assert_allclose(float(total / tokens), float(loss), rtol=1e-5)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=2e-4, atol=1e-7),
                 step_grads, grads)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


# -- training only ---------------------------------------------------------------------------

def test_dropout_moves_the_training_loss_and_not_eval_or_the_model_sampled(single, one_device,
                                                                          reference):
    """Evaluation is the reference with every mask one (so the reference is the model, less
    dropout), and the train step's loss at the same parameters is not. Sampling and export
    build their model from `model_spec`, whose graph is the same whatever the rate (this test
    does not sample)."""
    state = jax.device_get(adapted_state(single))
    batch = random_batch(single.config)
    summed, tokens = single.eval_step(state.model_params(), jax.device_put(
        batch, single.batch_sharding))
    undropped = reference(state.params, state.frozen, jax.tree.map(jnp.asarray, batch),
                          no_masks(single.config))[0]
    np.testing.assert_allclose(float(summed / tokens), float(undropped), rtol=1e-5)
    assert abs(one_device[0] - float(undropped)) > 1e-3
    assert model_spec(single.config).graphdef == model_spec(dropout_config(0.0)).graphdef


def test_without_dropout_the_step_draws_no_random_bits():
    def random_ops(config):
        program = program_for(config)
        traced = program.train_step.trace(program.abstract_state, program.abstract_batch())
        return str(traced.jaxpr).count("random_")
    assert random_ops(dropout_config(rate=0.0)) == 0
    assert random_ops(dropout_config()) > 0


# -- the same masks everywhere, every time ---------------------------------------------------

@pytest.mark.parametrize("mesh", [
    dict(data=2, fsdp=2, tensor=2, remat="full"),
    pytest.param(dict(microbatches=1), marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, fsdp=2, schedule="gpipe"), marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, tensor=2, schedule="1f1b", remat="save_dots"),
                 marks=pytest.mark.slow),
    pytest.param(dict(pipeline=2, repeats=2, schedule="gpipe"), marks=pytest.mark.slow),
], ids=["data-fsdp-tensor-remat", "one-microbatch", "pipeline-gpipe", "pipeline-1f1b",
        "pipeline-circular"])
def test_every_layout_draws_the_masks_of_one_device(mesh, single, one_device):
    """Remat recomputes the blocks from the same keys: the same masks again. The batch in one
    piece draws what its two microbatches draw."""
    mesh = dict(mesh)
    remat, repeats = mesh.pop("remat", "none"), mesh.pop("repeats", 1)
    microbatches = mesh.pop("microbatches", 2)
    config = dropout_config(**mesh)
    config.model.remat = remat
    config.train.microbatches = microbatches
    expected = one_device
    if repeats > 1:  # 2 stages x 2 repeats need 4 layers: one device runs 4 too
        config.model.n_layers = 4
        config.pipeline.repeats = repeats
        single_config = dropout_config()
        single_config.model.n_layers = 4
        expected = train_step(program_for(single_config))
    np.testing.assert_allclose(train_step(program_for(config)), expected, rtol=1e-5)


def test_a_step_replays_its_masks_and_the_next_step_draws_others(single):
    batch = jax.device_put(random_batch(single.config), single.batch_sharding)
    runs = [single.train_step(adapted_state(single, step), batch) for step in (5, 5, 6)]
    (state_a, a), (state_b, b), (_, c) = jax.device_get(runs)
    assert float(a["loss"]) == float(b["loss"])
    jax.tree.map(np.testing.assert_array_equal, state_a.params, state_b.params)
    assert abs(float(a["loss"]) - float(c["loss"])) > 1e-4

    # Keys alone decide: another step, row, layer or target draws another mask.
    drop = lora.AdapterDropout.for_rows(0.5, lora.dropout_key(0, 5), 4)
    ones = jnp.ones((4, 16, 8))
    masks = [drop(ones), drop(ones), drop.folded(1)(ones), drop.folded(2)(ones),
             lora.AdapterDropout.for_rows(0.5, lora.dropout_key(0, 6), 4)(ones)]
    np.testing.assert_array_equal(masks[0], masks[1])
    assert set(np.unique(masks[0])) == {0.0, 2.0}  # kept elements scaled by 1 / (1 - p)
    for other in masks[2:]:
        assert not np.array_equal(masks[0], other)
    assert not np.array_equal(masks[0][0], masks[0][1])


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_a_rate_outside_zero_to_one_is_a_config_error(rate):
    config = dropout_config(rate=rate)
    message = one_line_error(ConfigError, lambda: check_schema(config))
    assert f"model.lora.dropout={rate}" in message
    check_schema(dropout_config(rate=0.5))
