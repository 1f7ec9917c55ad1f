"""FP8 matmuls (precision.matmul='fp8', jaxscale/models/fp8.py) on CPU, where XLA emulates the
fp8 types: the delayed scaling's arithmetic against a hand computation, the products against
float32 ones, the meta through a train step (microbatches, remat), checkpoints across
bfloat16 <-> fp8, and the bad inputs (tiny's loss curve against bfloat16's:
tests/test_fp8_training.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.checkpoint import Checkpoints
from jaxscale.checks import validate
from jaxscale.errors import ConfigError
from jaxscale.models.fp8 import check_fp8, fp8_matmul, next_meta, step_meta
from jaxscale.models.layers import weight_matmul
from jaxscale.plan.search import candidates
from jaxscale.trainer import Trainer
from jaxscale.training.state import TrainState
from tests.helpers import random_batch, small_config

E4M3_MAX, E5M2_MAX = 448.0, 57344.0  # the largest finite float8_e4m3fn, float8_e5m2
SPEC = "btd,df->btf"


def fp8_config(matmul="fp8", **mesh):
    c = small_config(**mesh)
    c.precision.update(compute_dtype="bfloat16", matmul=matmul, fp8_amax_history=4)
    c.checkpoint.compilation_cache = False
    return c


def meta(history, x=(1.0, ()), weight=(1.0, ()), grad=(1.0, ())):
    """An `Fp8Site.values()` tuple: each operand's (scale, amaxes already in its history)."""
    def operand(scale, amaxes):
        h = np.zeros(history, np.float32)
        h[:len(amaxes)] = amaxes
        return jnp.asarray([scale], jnp.float32), jnp.asarray(h)
    return (*operand(*x), *operand(*weight), *operand(*grad))


NAMES = ("x_scale", "x_history", "weight_scale", "weight_history", "grad_scale", "grad_history")


def step(x, w, g, state):
    """fp8_matmul's output and its gradients (x, weight) for cotangent g, and the meta after the
    step: as a train step makes it, from the step's meta (`step_meta`) and the amaxes the
    matmul's backward returns for its sinks (`next_meta`)."""
    meta = dict(zip(NAMES, state))
    taken = step_meta(meta)
    out, vjp = jax.vjp(lambda x, w, m: fp8_matmul(SPEC, x.dtype, w.dtype, x.dtype, x, w, m),
                       x, w, tuple(taken[name] for name in NAMES))
    grad_x, grad_w, amaxes = vjp(g)
    after = next_meta(meta, taken, dict(zip(NAMES, amaxes)))
    return out, grad_x, grad_w, tuple(after[name] for name in NAMES)


def test_delayed_scaling_matches_a_hand_computation():
    """Five steps of different magnitudes through a history of 3: each step's scale is the
    largest amax of the 3 steps before it over the format's max (the first keeps scale 1, its
    history being empty), and the history then holds the last 3 amaxes."""
    rng = np.random.default_rng(0)
    history = 3
    state = meta(history)
    seen = {"x": [], "weight": [], "grad": []}
    for magnitude in (0.5, 8.0, 0.01, 3.0, 0.2):
        x = jnp.asarray(rng.normal(size=(2, 3, 8)) * magnitude, jnp.float32)
        w = jnp.asarray(rng.normal(size=(8, 5)) * magnitude / 2, jnp.float32)
        g = jnp.asarray(rng.normal(size=(2, 3, 5)) * magnitude / 100, jnp.float32)
        _, _, _, state = step(x, w, g, state)
        got = dict(zip(("x", "weight", "grad"), zip(state[0::2], state[1::2])))
        for name, value, fp8_max in (("x", x, E4M3_MAX), ("weight", w, E4M3_MAX),
                                     ("grad", g, E5M2_MAX)):
            before = seen[name][-history:]
            want_scale = max(before) / fp8_max if before else 1.0
            seen[name].append(float(np.max(np.abs(np.asarray(value)))))
            want_history = sorted((seen[name][-history:] + [0.0] * history)[:history])
            scale, amaxes = got[name]
            np.testing.assert_allclose(np.asarray(scale), [want_scale], rtol=1e-6)
            np.testing.assert_allclose(np.sort(np.asarray(amaxes)), want_history, rtol=1e-6)


def test_fp8_product_and_gradients_are_within_what_fp8_rounding_allows():
    """With scales set from the operands' own amaxes (as after a step of the same data), the
    forward product is within e4m3's rounding of the float32 one (3 mantissa bits: each operand
    off by at most 2^-4 relative), the gradients within e5m2's (2 bits: 2^-3) times e4m3's. A
    bfloat16 product would pass the bounds too; the check that the error exceeds bfloat16's
    catches it."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 16, 64)).astype(np.float32)
    w = (rng.normal(size=(64, 32)) * 0.02).astype(np.float32)
    g = (rng.normal(size=(4, 16, 32)) * 1e-4).astype(np.float32)
    def amax(a):
        return float(np.max(np.abs(a)))
    state = meta(4, x=(1.0, [amax(x)]), weight=(1.0, [amax(w)]), grad=(1.0, [amax(g)]))
    out, grad_x, grad_w, _ = step(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w),
                                  jnp.asarray(g, jnp.bfloat16), state)
    x64, w64, g64 = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (x, w, g))
    e4m3, e5m2, bf16 = 2.0 ** -4, 2.0 ** -3, 2.0 ** -8
    checks = (  # (fp8 result, float64 reference, its sum of |terms|, product's error bound)
        (out, np.einsum(SPEC, x64, w64), np.einsum(SPEC, abs(x64), abs(w64)),
         2 * e4m3 + e4m3 ** 2),
        (grad_x, np.einsum("btf,df->btd", g64, w64), np.einsum("btf,df->btd", abs(g64), abs(w64)),
         e5m2 + e4m3 + e5m2 * e4m3),
        (grad_w, np.einsum("btd,btf->df", x64, g64), np.einsum("btd,btf->df", abs(x64), abs(g64)),
         e5m2 + e4m3 + e5m2 * e4m3))
    for got, want, terms, bound in checks:
        err = np.abs(np.asarray(got, np.float64) - want)
        # The result's own rounding (bfloat16 outputs) on top of the operands'.
        assert np.all(err <= bound * terms + bf16 * np.abs(want) + 1e-12)
        # fp8 was really used: a bfloat16 product is off by ~2e-4 of the terms' sum here (fp8's
        # forward by ~6e-3), under this 4.9e-4.
        assert np.mean(err) > bf16 / 8 * np.mean(terms)
    assert out.dtype == jnp.bfloat16 and grad_x.dtype == jnp.bfloat16
    assert grad_w.dtype == jnp.float32  # the weight's own dtype: what it is reduced in


def test_weight_matmul_without_fp8_is_unchanged():
    """The bfloat16 path is the plain cast-then-einsum product."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
    np.testing.assert_array_equal(weight_matmul(SPEC, x, w),
                                  jnp.einsum(SPEC, x, w.astype(jnp.bfloat16)))


def train_steps(config, steps=3, devices=None, workdir=None):
    trainer = Trainer(config, str(workdir), devices=devices or jax.devices()[:1])
    batch = jax.device_put(random_batch(config), trainer.program.batch_sharding)
    state, losses = trainer.program.init_state(0), []
    for _ in range(steps):
        state, metrics = trainer.program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses, trainer


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """(state, losses, trainer) of fp8_config() after 3 steps on one device: the run the tests
    below read or compare with, its step compiled once for all of them."""
    return train_steps(fp8_config(), workdir=tmp_path_factory.mktemp("fp8"))


def test_the_meta_is_state_beside_the_params(fp8_run, tmp_path):
    """The meta is stacked by layer, outside params and the optimizer, updated every step; the
    params are the bfloat16 model's, and evaluation runs them without meta."""
    state, losses, trainer = fp8_run
    site = state.fp8["blocks"]["attn"]["q_fp8"]
    assert {k: v.shape for k, v in site.items()} == {
        f"{o}_{k}": (2, 1) if k == "scale" else (2, 4)
        for o in ("x", "weight", "grad") for k in ("scale", "history")}
    history = np.asarray(site["x_history"])
    assert np.all(np.count_nonzero(history, axis=1) == 3)  # three steps measured, one slot left
    assert set(state.fp8["blocks"]["mlp"]) == {"gate_fp8", "up_fp8", "down_fp8"}
    bf16 = Trainer(fp8_config("bfloat16"), str(tmp_path / "bf16"), devices=jax.devices()[:1])
    assert jax.tree.structure(state.params) == jax.tree.structure(
        bf16.program.abstract_state.params)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(
        bf16.program.abstract_state.opt_state)
    assert losses[-1] < losses[0]
    batch = jax.device_put(random_batch(trainer.config), trainer.program.batch_sharding)
    total, tokens = trainer.program.eval_step(state.params, batch)
    assert np.isfinite(float(total)) and float(tokens) > 0


@pytest.mark.slow
def test_microbatches_combine_the_meta_by_maximum(tmp_path):
    """Two microbatches give the meta of one batch (a sum would double every amax)."""
    one, _, _ = train_steps(fp8_config(), steps=1, workdir=tmp_path / "one")
    config = fp8_config()
    config.train.microbatches = 2
    two, _, _ = train_steps(config, steps=1, workdir=tmp_path / "two")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2), two.fp8, one.fp8)


@pytest.mark.parametrize("remat", ["full", pytest.param("save_dots", marks=pytest.mark.slow)])
def test_remat_policies_give_the_same_fp8_step(fp8_run, tmp_path, remat):
    """Recomputing the forward quantizes the same way: the same losses, params and meta after
    the 3 steps of `fp8_run`, which recomputes nothing."""
    want, want_losses, _ = fp8_run
    config = fp8_config()
    config.model.remat = remat
    got, got_losses, _ = train_steps(config, workdir=tmp_path / remat)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 (got.params, got.fp8), (want.params, want.fp8))


def save_one_step(matmul, workdir):
    config = fp8_config(matmul, fsdp=2)
    state, _, _ = train_steps(config, steps=1, devices=jax.devices()[:2], workdir=workdir)
    with Checkpoints(config, str(workdir)) as checkpoints:
        checkpoints.save(1, state, {}, {"step": 1})
    return jax.device_get(state)


@pytest.mark.parametrize("written, restored", [
    pytest.param("bfloat16", "fp8", marks=pytest.mark.slow), ("fp8", "bfloat16"),
    pytest.param("fp8", "fp8", marks=pytest.mark.slow)])
def test_checkpoints_restore_across_matmul_precisions(tmp_path, written, restored):
    """A bfloat16 checkpoint restores into an fp8 run with fresh scales (1) and histories (0);
    an fp8 checkpoint into a bfloat16 run without its meta, into an fp8 run with it; the
    restored state takes a step."""
    saved = save_one_step(written, tmp_path / "written")
    assert os.path.isdir(tmp_path / "written" / "checkpoints" / "1" / "fp8") == (written == "fp8")
    config = fp8_config(restored, fsdp=2)
    config.checkpoint.dir = str(tmp_path / "written" / "checkpoints")
    trainer = Trainer(config, str(tmp_path / "run"), devices=jax.devices()[:2])
    with Checkpoints(config, str(tmp_path / "run")) as checkpoints:
        got = checkpoints.restore_newest(trainer.program.abstract_state)
    state = TrainState(params=got.params, **got.train)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), saved.params)
    if restored == "bfloat16":
        assert state.fp8 is None
    elif written == "bfloat16":
        for name, value in jax.tree_util.tree_leaves_with_path(state.fp8):
            fresh = 1.0 if jax.tree_util.keystr(name).endswith("_scale']") else 0.0
            np.testing.assert_array_equal(value, np.full(value.shape, fresh))
    else:
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.fp8), saved.fp8)
    assert jax.tree.map(lambda a: a.sharding, state) == trainer.program.state_shardings
    batch = jax.device_put(random_batch(config), trainer.program.batch_sharding)
    _, metrics = trainer.program.train_step(state, batch)
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_an_fp8_checkpoint_with_another_history_length_is_refused(tmp_path):
    save_one_step("fp8", tmp_path / "written")
    config = fp8_config(fsdp=2)
    config.precision.fp8_amax_history = 8
    config.checkpoint.dir = str(tmp_path / "written" / "checkpoints")
    trainer = Trainer(config, str(tmp_path / "run"), devices=jax.devices()[:2])
    with Checkpoints(config, str(tmp_path / "run")) as checkpoints, \
            pytest.raises(ConfigError, match=r"fp8 scale entry .*_history' is float32\[2, 4\] in "
                                             r"the checkpoint but float32\[2, 8\]"):
        checkpoints.restore_newest(trainer.program.abstract_state)


class FakeDevice:
    def __init__(self, platform, compute_capability=""):
        self.platform, self.compute_capability = platform, compute_capability


@pytest.mark.parametrize("key, value, names", [
    ("matmul", "int8", ["precision.matmul='int8'", "'bfloat16', 'fp8'"]),
    ("compute_dtype", "float16", ["precision.compute_dtype='bfloat16'", "'float16'"]),
    ("compute_dtype", "float32", ["precision.compute_dtype='bfloat16'", "'float32'"]),
    ("fp8_amax_history", 0, ["precision.fp8_amax_history"]),
])
def test_bad_precision_settings_are_refused(key, value, names):
    config = fp8_config()
    config.precision[key] = value
    with pytest.raises(ConfigError) as raised:
        validate(config, 1)
    for name in names:
        assert name in str(raised.value)


@pytest.mark.parametrize("device, refused", [
    (FakeDevice("gpu", "8.0"), "compute capability '8.0'"),  # A100
    (FakeDevice("gpu", "8.6"), "compute capability '8.6'"),
    (FakeDevice("gpu", "gfx942"), "compute capability 'gfx942'"),  # ROCm: no CUDA capability
    (FakeDevice("gpu", "8.9"), None), (FakeDevice("gpu", "9.0"), None),  # Ada, Hopper
    (FakeDevice("gpu", "10.0"), None),
    (FakeDevice("cpu"), None), (FakeDevice("tpu"), None),  # emulated by XLA
])
def test_fp8_needs_fp8_tensor_cores_on_a_gpu(device, refused):
    check_fp8("bfloat16", device)  # bfloat16 runs anywhere
    if refused is None:
        check_fp8("fp8", device)
        return
    with pytest.raises(ConfigError, match=f"precision.matmul='fp8' needs a GPU with fp8 tensor "
                                          f"cores .*{refused}.*precision.matmul=bfloat16"):
        check_fp8("fp8", device)


def test_fp8_with_pipeline_stages_is_refused_by_the_device_free_check():
    """`validate` refuses it (what the planner's search and the launchers' pre-check run, with
    no devices), not only the trainer's device checks."""
    config = fp8_config(pipeline=2)
    with pytest.raises(ConfigError, match="precision.matmul='fp8' with mesh.pipeline=2 stages"):
        validate(config, 2)
    config.precision.matmul = "bfloat16"
    validate(config, 2)


def test_the_planner_offers_an_fp8_run_no_layout_with_pipeline_stages():
    """Every layout the planner searches is one the run accepts: for fp8 none has stages (the
    same model in bfloat16 has some), so mesh.auto cannot choose a layout the trainer refuses."""
    config = fp8_config()
    found = candidates(config, 8)
    assert found and all(c.mesh_shape["pipeline"] == 1 for c in found)
    config.precision.matmul = "bfloat16"
    assert any(c.mesh_shape["pipeline"] > 1 for c in candidates(config, 8))
