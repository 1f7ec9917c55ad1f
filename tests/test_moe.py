"""Mixture of experts (issue 13): the MoE layer against a dense per-token reference written here,
dropping and the load-balancing loss against hand counts, the Mixtral parameter counts from
shapes, the model (decode, remat, the loss's penalties), expert parallelism (the loss and
gradients on expert meshes, where the experts and their optimizer state live, the all-to-all),
the CLI (training, restore across expert degrees), and bad inputs."""

import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale.cli import load_config_file
from jaxscale.models.llama import LlamaConfig
from jaxscale.models.moe import MoE, MoEConfig, route
from jaxscale.models.spec import abstract_model, create_model, model_config, model_spec
from jaxscale.training.step import Objective, Weights, router_metrics
from tests.helpers import loss_and_gradients_on_mesh, mesh_trainer, random_batch, small_config
from tests.test_bad_inputs import config_file, run_in_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RNG = np.random.default_rng(0)


def randn(*shape, scale=1.0):
    return jnp.asarray(RNG.standard_normal(shape) * scale, jnp.float32)


def moe_layer(d_model=16, mlp_dim=24, experts=4, top_k=2, capacity_factor=1.25):
    cfg = MoEConfig(experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    return MoE(d_model, mlp_dim, cfg, out_stddev=0.02, dtype=jnp.float32, rngs=nnx.Rngs(0))


def set_params(layer, **weights):
    for name, value in weights.items():
        getattr(layer, name)[...] = jnp.asarray(value, jnp.float32)


# --- the layer against a dense reference ---------------------------------------------------------

def reference_moe(params, x, chosen):
    """Every token, one at a time, through its chosen experts: y_t = sum over its choices of
    p_e / (sum of its chosen p) * swiglu_e(x_t). `chosen` [batch, tokens, top_k] is fixed (the
    choice itself has no gradient). Returns (y, aux, z), aux and z from their definitions."""
    router, gate, up, down = (params[k] for k in ("router", "gate", "up", "down"))
    batch, tokens, _ = x.shape
    experts = router.shape[1]
    logits = jnp.einsum("btd,de->bte", x, router)
    probs = jax.nn.softmax(logits, axis=-1)
    rows = []
    for b in range(batch):
        row = []
        for t in range(tokens):
            picked = [int(e) for e in chosen[b, t]]
            norm = sum(probs[b, t, e] for e in picked)
            out = 0.0
            for e in picked:
                hidden = jax.nn.silu(x[b, t] @ gate[e]) * (x[b, t] @ up[e])
                out = out + probs[b, t, e] / norm * (hidden @ down[e])
            row.append(out)
        rows.append(jnp.stack(row))
    y = jnp.stack(rows)
    counts = np.bincount(np.asarray(chosen).reshape(-1), minlength=experts)
    share = counts / chosen.size
    aux = experts * jnp.sum(share * jnp.mean(probs, axis=(0, 1)))
    z = jnp.mean(jax.scipy.special.logsumexp(logits, axis=-1) ** 2)
    return y, aux, z


# capacity_factor experts / top_k: every expert has a slot for every token, none dropped; 0:
# dropless, the grouped matmuls (jax.lax.ragged_dot) over the tokens sorted by expert.
@pytest.mark.parametrize("capacity_factor", [2.0, 0.0], ids=["capacity", "dropless"])
def test_layer_output_loss_and_gradients_equal_a_dense_per_token_reference(capacity_factor):
    experts, top_k = 4, 2
    layer = moe_layer(experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    set_params(layer, router=randn(16, experts), gate=randn(experts, 16, 24, scale=0.3),
               up=randn(experts, 16, 24, scale=0.3), down=randn(experts, 24, 16, scale=0.3))
    x, probe = randn(2, 6, 16), randn(2, 6, 16)
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    logits = np.einsum("btd,de->bte", np.asarray(x), np.asarray(params["router"]))
    chosen = np.argsort(-logits, axis=-1, kind="stable")[..., :top_k]

    def loss(y, aux, z):  # any scalar of the output, plus the router penalties
        return jnp.sum(y * probe) + 0.01 * aux + 0.001 * z

    def layer_loss(params, x):
        y, stats = nnx.merge(graphdef, params)(x)
        return loss(y, stats.aux_loss, stats.z_loss), (y, stats)

    (got_loss, (y, stats)), got_grads = jax.jit(jax.value_and_grad(
        layer_loss, argnums=(0, 1), has_aux=True))(params, x)
    def ref(params, x):
        return loss(*reference_moe(params, x, chosen))
    want_loss, want_grads = jax.jit(jax.value_and_grad(ref, argnums=(0, 1)))(params, x)
    want_y, want_aux, want_z = jax.jit(lambda p, x: reference_moe(p, x, chosen))(params, x)

    assert float(stats.dropped_fraction) == 0.0
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats.aux_loss, want_aux, rtol=1e-5)
    np.testing.assert_allclose(stats.z_loss, want_z, rtol=1e-5)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- dropping and the load-balancing loss, by hand ----------------------------------------------

# Router = identity, so a token's logits are its input: the first choice scores 2, the second 1.
FIRST = [0, 0, 0, 0, 1, 1]
SECOND = [1, 1, 2, 2, 0, 0]


def hand_routed_tokens():
    x = np.zeros((1, 6, 4), np.float32)
    for t, (a, b) in enumerate(zip(FIRST, SECOND)):
        x[0, t, a], x[0, t, b] = 2.0, 1.0
    return jnp.asarray(x)


def test_dropped_fraction_and_priority_equal_a_hand_count():
    # 6 tokens x top-2 over 4 experts, capacity_factor 1: ceil(6 * 2 / 4) = 3 slots per expert.
    # First choices go first, then second choices, each in token order:
    #   expert 0: t0 t1 t2 (first choices) fill it; t3's first choice and t4, t5's second drop
    #   expert 1: t4 t5 (first), then t0 (second); t1's second choice drops
    #   expert 2: t2 t3 (second)
    # Dropped: 4 of 12 assignments.
    layer = moe_layer(d_model=4, experts=4, top_k=2, capacity_factor=1.0)
    set_params(layer, router=np.eye(4))
    x = hand_routed_tokens()
    y, stats = layer(x)
    assert float(stats.dropped_fraction) == pytest.approx(4 / 12)
    # Before dropping: expert 0 was chosen 6 times, expert 1 4 times, expert 2 twice.
    np.testing.assert_allclose(stats.expert_load, [6 / 12, 4 / 12, 2 / 12, 0])
    routing = route(jax.nn.softmax(x[0]), top_k=2, capacity=3)
    kept = np.asarray(routing.slot < 3).reshape(2, 6)  # [choice, token]
    np.testing.assert_array_equal(kept, [[1, 1, 1, 0, 1, 1], [1, 0, 1, 1, 0, 0]])
    # t3 lost its first choice: only its second expert's share (p2 / (p0 + p2)) reaches it.
    probs = jax.nn.softmax(x[0, 3])
    hidden = jax.nn.silu(x[0, 3] @ layer.gate[2]) * (x[0, 3] @ layer.up[2])
    want = probs[2] / (probs[0] + probs[2]) * (hidden @ layer.down[2])
    np.testing.assert_allclose(y[0, 3], want, rtol=1e-5, atol=1e-7)


def test_padding_takes_no_slot_and_is_left_out_of_the_statistics():
    """The hand-routed row of the test above with t0 and t1 padding: expert 0 now takes t2, t3
    (first choices) and t4 (second); t5's second choice is the only drop, 1 of 8 real
    assignments. Padding outputs zero, and the load counts the real assignments only."""
    layer = moe_layer(d_model=4, experts=4, top_k=2, capacity_factor=1.0)
    set_params(layer, router=np.eye(4))
    x = hand_routed_tokens()
    valid = jnp.asarray([[False, False, True, True, True, True]])
    y, stats = layer(x, valid)
    routing = route(jax.nn.softmax(x[0]), top_k=2, capacity=3, valid=valid[0])
    kept = np.asarray(routing.slot < 3).reshape(2, 6)
    np.testing.assert_array_equal(kept, [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    assert float(stats.dropped_fraction) == pytest.approx(1 / 8)
    np.testing.assert_allclose(stats.expert_load, [4 / 8, 2 / 8, 2 / 8, 0])
    np.testing.assert_array_equal(y[0, :2], 0.0)


def test_dropless_drops_nothing_where_capacity_mode_drops():
    """The hand-routed row (expert 0 chosen 6 times, 3 slots at capacity_factor 1, 4 drops):
    dropless keeps all 12 assignments and every token equals the per-token reference."""
    x = hand_routed_tokens()
    capacity, dropless = (moe_layer(d_model=4, mlp_dim=6, capacity_factor=f) for f in (1.0, 0.0))
    weights = dict(router=np.eye(4), gate=randn(4, 4, 6), up=randn(4, 4, 6), down=randn(4, 6, 4))
    set_params(capacity, **weights)
    set_params(dropless, **weights)
    (y_capacity, dropped), (y, stats) = capacity(x), dropless(x)
    assert float(dropped.dropped_fraction) == pytest.approx(4 / 12)
    assert float(stats.dropped_fraction) == 0.0
    np.testing.assert_allclose(stats.expert_load, [6 / 12, 4 / 12, 2 / 12, 0])
    chosen = np.array([list(zip(FIRST, SECOND))])
    want, _, _ = reference_moe({k: jnp.asarray(v, jnp.float32) for k, v in weights.items()}, x,
                               chosen)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(y_capacity, want, atol=1e-3)  # the drops the reference does not have


def test_dropless_padding_routes_nowhere_and_is_left_out_of_the_statistics():
    """The hand-routed row with t0 and t1 padding, dropless: the 8 real assignments all run
    (expert 0: t2, t3 first, t4, t5 second; expert 1: t4, t5; expert 2: t2, t3), padding
    outputs zero, and real tokens' outputs are those of the row without its padding."""
    layer = moe_layer(d_model=4, experts=4, top_k=2, capacity_factor=0.0)
    set_params(layer, router=np.eye(4))
    x = hand_routed_tokens()
    valid = jnp.asarray([[False, False, True, True, True, True]])
    y, stats = layer(x, valid)
    assert float(stats.dropped_fraction) == 0.0
    np.testing.assert_allclose(stats.expert_load, [4 / 8, 2 / 8, 2 / 8, 0])
    np.testing.assert_array_equal(y[0, :2], 0.0)
    alone, alone_stats = layer(x[:, 2:])
    np.testing.assert_allclose(y[:, 2:], alone, rtol=1e-6, atol=1e-7)
    for a, b in zip(stats, alone_stats):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_what_padding_holds_changes_no_real_tokens_output_or_statistic():
    """Real tokens' outputs and every router statistic are those of the real tokens alone: new
    random values in the padding change nothing (routed like tokens, they would take slots)."""
    layer = moe_layer(capacity_factor=1.0)
    valid = jnp.asarray(RNG.random((2, 12)) < 0.6)
    x = randn(2, 12, 16)
    other = jnp.where(valid[..., None], x, randn(2, 12, 16, scale=5.0))
    (y, stats), (y_other, stats_other) = layer(x, valid), layer(other, valid)
    np.testing.assert_allclose(jnp.where(valid[..., None], y, 0),
                               jnp.where(valid[..., None], y_other, 0), rtol=1e-6, atol=1e-7)
    for a, b in zip(stats, stats_other):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The closed forms over the real tokens: the z-loss's mean and the load's denominator.
    logits = jnp.einsum("btd,de->bte", x, layer.router[...])
    lse = jax.nn.logsumexp(logits, axis=-1)
    assert float(stats.z_loss) == pytest.approx(float(jnp.mean(jnp.square(lse[valid]))),
                                                rel=1e-5)
    assert float(jnp.sum(stats.expert_load)) == pytest.approx(1.0)


def test_aux_loss_and_z_loss_equal_their_closed_forms():
    # Probabilities by hand; top-1, so each token's choice is its 0.7.
    probs = np.array([[0.7, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1],
                      [0.1, 0.7, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]], np.float32)
    layer = moe_layer(d_model=4, experts=4, top_k=1, capacity_factor=4.0)
    set_params(layer, router=np.eye(4))
    _, stats = layer(jnp.asarray(np.log(probs) + 1.5)[None])  # logsumexp = log(1) + 1.5
    # load (1/2, 1/4, 0, 1/4), mean probabilities (0.4, 0.25, 0.1, 0.25):
    # aux = 4 * (0.5 * 0.4 + 0.25 * 0.25 + 0 * 0.1 + 0.25 * 0.25) = 1.3; z = 1.5^2.
    assert float(stats.aux_loss) == pytest.approx(1.3, rel=1e-5)
    assert float(stats.z_loss) == pytest.approx(2.25, rel=1e-5)
    np.testing.assert_allclose(stats.expert_load, [0.5, 0.25, 0.0, 0.25])
    assert float(stats.dropped_fraction) == 0.0


def test_a_single_choice_keeps_its_probability_so_the_router_learns_from_the_loss():
    """top_k=1 weighs the output by the raw router probability (Switch): renormalised it would be
    1, and the router would get no gradient from the loss."""
    layer = moe_layer(d_model=4, experts=4, top_k=1, capacity_factor=4.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 4)), jnp.float32)
    graphdef, state = nnx.split(layer)

    def output_sum(state):
        return jnp.sum(nnx.merge(graphdef, state)(x)[0])
    router_grad = jax.grad(output_sum)(state)["router"][...]
    assert float(jnp.max(jnp.abs(router_grad))) > 1e-6  # exactly 0 when renormalised


# --- Mixtral's parameter counts, from shapes ----------------------------------------------------

def test_mixtral_parameter_counts_match_the_published_figures():
    spec = model_spec(load_config_file(os.path.join(REPO, "configs", "mixtral_8x7b.py")))
    total, active = spec.num_params, spec.config.active_params(spec.num_params)
    assert total == 46_702_792_704  # Hugging Face's count for Mixtral-8x7B-v0.1
    assert total == pytest.approx(46.7e9, rel=0.005)  # "46.7B"
    assert active == pytest.approx(12.9e9, rel=0.005)  # "12.9B active"
    # The MFU's FLOPs count the active parameters, less the input embedding (a lookup).
    seq_len, cfg = 4096, spec.config
    attention = 12.0 * 32 * 32 * 128 * seq_len
    assert cfg.flops_per_token(total, seq_len) == 6.0 * (active - 32000 * 4096) + attention


# --- the model ----------------------------------------------------------------------------------

def moe_model_config(every=2, capacity_factor=1.25, remat="none"):
    return LlamaConfig(vocab_size=259, vocab_multiple=128, d_model=32, n_layers=4, n_heads=4,
                       n_kv_heads=2, head_dim=8, mlp_dim=48, dtype="float32", remat=remat,
                       moe=MoEConfig(experts=4, top_k=2, capacity_factor=capacity_factor,
                                     every=every))


def split_model(cfg):
    """(graphdef, params) of a fresh model, initialised under jit (eagerly it takes seconds)."""
    return nnx.graphdef(abstract_model(cfg)), jax.jit(lambda: nnx.state(create_model(cfg, 0)))()


def test_every_nth_layer_is_moe_and_the_stack_stays_homogeneous():
    model = abstract_model(moe_model_config(every=2))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))["blocks"]["layers"]
    assert sorted(params[0]["mlp"]) == ["down", "gate", "up"]  # dense
    assert params[0]["mlp"]["gate"].shape == (2, 32, 48)  # 2 groups of 2 layers
    assert sorted(params[1]["mlp"]) == ["down", "gate", "router", "up"]
    assert params[1]["mlp"]["gate"].shape == (2, 4, 32, 48)  # [groups, experts, ...]


@pytest.mark.parametrize("every", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kv_cache_decoding_equals_the_full_forward_pass(every):
    # Enough capacity that the full pass drops nothing; decoding never drops.
    graphdef, params = split_model(moe_model_config(every=every, capacity_factor=2.0))
    tokens = jnp.asarray(RNG.integers(3, 259, (2, 10)), jnp.int32)
    full, stats = jax.jit(lambda p, t: nnx.merge(graphdef, p).features(t))(params, tokens)
    assert float(stats.dropped_fraction) == 0.0

    @jax.jit
    def decode(p, tokens, cache, start):
        return nnx.merge(graphdef, p).decode(tokens, cache, start)

    cache = nnx.merge(graphdef, params).init_cache(2, 10)
    features, cache = decode(params, tokens[:, :6], cache, 0)
    steps = [features]
    for i in range(6, 10):
        features, cache = decode(params, tokens[:, i:i + 1], cache, i)
        steps.append(features)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_remat_keeps_the_loss_and_gradients():
    batch = random_batch(small_config())

    def loss_and_grads(remat):
        graphdef, params = split_model(moe_model_config(remat=remat))

        def mean_loss(p):
            total, tokens, stats = Objective(graphdef).summed_loss(Weights(p), batch)
            return total / tokens + 0.01 * stats.aux_loss
        return jax.jit(jax.value_and_grad(mean_loss))(params)

    for got, want in zip(jax.tree.leaves(loss_and_grads("full")),
                         jax.tree.leaves(loss_and_grads("none"))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_the_mean_loss_gains_exactly_the_weighted_router_penalties():
    config = small_config()
    config.model.moe.update(experts=4, top_k=2, every=1, aux_loss_weight=0.5, z_loss_weight=0.25)
    graphdef, params = split_model(model_config(config))
    batch = random_batch(config)
    tokens = float(np.sum(batch["loss_mask"]))
    total, grads, router, _ = jax.jit(lambda p: Objective.of(config, graphdef, None)
                                      .forward_backward(Weights(p), batch,
                                                        jnp.float32(1 / tokens)))(params)
    metrics = router_metrics(router)

    def mean_objective(p):
        ce, count, stats = Objective(graphdef).summed_loss(Weights(p), batch)
        return ce / count + 0.5 * stats.aux_loss + 0.25 * stats.z_loss
    want_grads = jax.jit(jax.grad(mean_objective))(params)
    ce, _, stats = jax.jit(lambda p: Objective(graphdef).summed_loss(Weights(p), batch))(params)
    assert float(total) == pytest.approx(float(ce), rel=1e-6)  # the reported loss: CE alone
    assert float(metrics["moe_aux_loss"]) == pytest.approx(float(stats.aux_loss), rel=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)


# --- expert parallelism -------------------------------------------------------------------------

def expert_config(**mesh):
    """The small model with 8 experts in every layer, float32; capacity for every token, so no
    degree drops anything and the meshes must agree exactly."""
    config = small_config(**mesh)
    config.model.moe.update(experts=8, top_k=2, every=1, capacity_factor=4.0)
    config.train.batch_size = 16
    return config


@pytest.mark.slow
def test_expert_meshes_give_one_devices_loss_and_gradients(tmp_path):
    ref_loss, ref_grads, _ = loss_and_gradients_on_mesh(expert_config(), tmp_path / "one")
    for mesh in (dict(expert=4, data=2), dict(expert=2, fsdp=2, data=2)):
        loss, grads, hlo = loss_and_gradients_on_mesh(expert_config(**mesh), tmp_path / str(mesh))
        assert "all-to-all" in hlo  # the tokens reach their experts' devices and come back
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
                     grads, ref_grads)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3


@pytest.mark.slow
def test_dropless_on_an_expert_mesh_gives_one_devices_loss_and_gradients(tmp_path):
    """Dropless on expert=2 x fsdp=2 x data=2 (the weights gathered to the tokens) equals capacity
    mode on one device with a slot for every token: nothing is dropped either way."""
    want = loss_and_gradients_on_mesh(expert_config(), tmp_path / "one")
    config = expert_config(expert=2, fsdp=2, data=2)
    config.model.moe.capacity_factor = 0.0
    got = loss_and_gradients_on_mesh(config, tmp_path / "mesh")
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
                 got.grads, want.grads)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(got.grads)) > 1e-3


def test_the_compiled_train_step_exchanges_tokens_by_all_to_all(tmp_path):
    compiled, _ = mesh_trainer(expert_config(expert=4, data=2), tmp_path).compile_train_step()
    assert "all-to-all" in compiled.as_text()


def device_bytes(tree, device):
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
               for s in leaf.addressable_shards if s.device == device)


def test_each_device_holds_a_quarter_of_the_experts_and_their_optimizer_state(tmp_path):
    trainer = mesh_trainer(expert_config(expert=4, data=2), tmp_path)
    state = trainer.program.init_state(0)
    def experts(tree):
        return [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                                if jax.tree_util.keystr(path[-1:]) in ("['gate']", "['up']",
                                                                       "['down']")]
    params, moments = experts(state.params), experts(state.opt_state)
    assert len(params) == 3 and len(moments) == 6  # Adam's mu and nu of each
    axis = trainer.program.mesh.axis_names.index("expert")
    for leaf in params + moments:  # [layers, experts, ...]: 2 experts on each expert index
        for shard in leaf.addressable_shards:
            index = np.argwhere(trainer.program.mesh.devices == shard.device)[0][axis]
            assert shard.index[1] == slice(2 * index, 2 * index + 2)
    device = trainer.program.mesh.devices.flat[0]
    whole = sum(leaf.nbytes for leaf in params + moments)
    assert device_bytes(params + moments, device) == whole // 4
    # The dense layers are split over the expert axis too (as data parallelism), not replicated.
    batch_spec = trainer.program.batch_sharding.spec[0]
    assert "expert" in batch_spec


# --- the command line ---------------------------------------------------------------------------

@pytest.mark.slow
def test_the_cli_trains_tiny_moe_and_the_loss_falls(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", "--config=configs/tiny_moe.py",
         f"--workdir={tmp_path}", "--config.train.steps=8", "--config.train.log_every=4",
         "--config.train.batch_size=16", "--config.train.seq_len=64",
         "--config.train.eval_every=0", "--config.checkpoint.enabled=False",
         "--config.train.microbatches=2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [l["loss"] for l in lines if "loss" in l]
    assert len(losses) == 2 and losses[-1] < losses[0]
    last = lines[-1]
    assert last["moe_aux_loss"] >= 1.0 - 1e-6  # its minimum, at an even load
    assert 0.0 <= last["moe_dropped_fraction"] < 1.0 and last["moe_z_loss"] > 0
    assert len(last["moe_expert_load"]) == 8 and sum(last["moe_expert_load"]) == \
        pytest.approx(1.0, rel=1e-5)


def run_tiny_moe(workdir, steps, **mesh):
    """configs/tiny_moe.py through the CLI, small and float32: {step: loss} of this run's
    steps (a resumed run appends to its workdir's metrics)."""
    metrics = workdir / "metrics.jsonl"
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    flags = {"train.steps": steps, "train.batch_size": 16, "train.seq_len": 32,
             "train.log_every": 1, "train.eval_every": 0, "precision.compute_dtype": "float32",
             "model.n_layers": 2, "model.moe.capacity_factor": 4.0, "optim.warmup_steps": 1,
             # A constant learning rate after warmup: a run of 2 steps takes the same steps as
             # the first 2 of a run of 4, so the two can be joined by a checkpoint.
             "optim.min_lr_ratio": 1.0, "checkpoint.every_steps": 2,
             "checkpoint.compilation_cache": False,
             **{f"mesh.{axis}": size for axis, size in mesh.items()}}
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", "--config=configs/tiny_moe.py",
         f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items())],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = [json.loads(l) for l in metrics.read_text().splitlines()[before:]]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


@pytest.mark.slow
def test_cli_trains_on_expert_meshes_and_restores_across_expert_degrees(tmp_path):
    """expert=1 for 4 steps; expert=4 for steps 1-2, restored on expert=2 x fsdp=2 for steps
    3-4; expert=2 x fsdp=2 for steps 1-2, restored on expert=1 for 3-4. Every step's loss
    equals the expert=1 run's."""
    plain = run_tiny_moe(tmp_path / "plain", 4)
    four = run_tiny_moe(tmp_path / "a", 2, expert=4)
    to_two = run_tiny_moe(tmp_path / "a", 4, expert=2, fsdp=2)
    two = run_tiny_moe(tmp_path / "b", 2, expert=2, fsdp=2)
    to_one = run_tiny_moe(tmp_path / "b", 4)
    assert sorted(plain) == [1, 2, 3, 4] and sorted(four) == sorted(two) == [1, 2]
    assert sorted(to_two) == sorted(to_one) == [3, 4]  # resumed at step 2's checkpoint
    want = [plain[s] for s in range(1, 5)]
    np.testing.assert_allclose([{**four, **to_two}[s] for s in range(1, 5)], want, rtol=1e-4)
    np.testing.assert_allclose([{**two, **to_one}[s] for s in range(1, 5)], want, rtol=1e-4)
    assert want[-1] < want[0]


BAD_MOE = [
    (["--config.model.moe.experts=4", "--config.model.moe.top_k=5"], "top_k=5"),
    (["--config.model.moe.experts=4", "--config.model.moe.every=3"], "every=3"),
    (["--config.model.moe.experts=4", "--config.model.moe.capacity_factor=3"],
     "capacity_factor=3"),
    (["--config.model.moe.experts=4", "--config.model.moe.capacity_factor=-1"],
     "capacity_factor=-1"),
    (["--config.model.moe.experts=1"], "experts=1"),
    (["--config.model.moe.every=-1"], "every=-1"),
    (["--config.model.moe.experts=4", "--config.model.moe.aux_loss_weight=-0.1"],
     "aux_loss_weight=-0.1"),
]


@pytest.mark.parametrize("args,names", BAD_MOE, ids=[n for _, n in BAD_MOE])
def test_bad_moe_settings_give_one_error_line(args, names, tmp_path, capfd):
    cfg = tmp_path / "small.py"
    cfg.write_text(config_file())
    workdir = tmp_path / "fresh"
    workdir.mkdir()
    every = [] if any("every" in a for a in args) else ["--config.model.moe.every=1"]
    capfd.readouterr()
    status, out, err = run_in_process(
        "jaxscale.train", [f"--config={cfg}", f"--workdir={workdir}", *every, *args], capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0], err
    assert "Traceback" not in out + err
    assert os.listdir(workdir) == []


def test_the_expert_load_is_a_json_list_and_a_tensorboard_histogram(tmp_path):
    from tensorboardX.proto import event_pb2

    from jaxscale.observe.metrics import MetricsWriter

    with MetricsWriter(str(tmp_path), enabled=True, total_steps=1, stream=io.StringIO()) as writer:
        writer.write(1, {"loss": 2.0, "moe_expert_load": np.array([0.5, 0.25, 0.25, 0.0])})
    line = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert line["moe_expert_load"] == [0.5, 0.25, 0.25, 0.0] and line["loss"] == 2.0
    (events,) = (tmp_path / "tensorboard").iterdir()
    data, histograms = events.read_bytes(), {}
    while data:  # TFRecords: length (8 bytes), its CRC (4), the event, its CRC (4)
        size = int.from_bytes(data[:8], "little")
        event = event_pb2.Event.FromString(data[12:12 + size])
        data = data[16 + size:]
        histograms.update({v.tag: v.histo for v in event.summary.value if v.HasField("histo")})
    load = histograms["train/moe_expert_load"]  # bucket i, [i, i + 1): expert i's share
    assert list(load.bucket) == [0.5, 0.25, 0.25, 0.0]
    assert list(load.bucket_limit) == [1.0, 2.0, 3.0, 4.0]
