"""`precision.grad_reduce_dtype`: the dtype the weight matmuls' gradients are made and summed over
the data-parallel devices in. Checked against plain autodiff and a float32 jax.grad written here,
on an 8-device data=8 mesh, and in the collectives of the program the TPU compiler makes."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.config import check_settings
from jaxscale.errors import ConfigError
from jaxscale.models import decoder
from jaxscale.models.layers import weight_matmul, weights_cast_for_use
from jaxscale.models.spec import abstract_model, create_model, model_config
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.targets import parse_target, target_devices
from jaxscale.training.step import Objective, Weights
from tests.helpers import loss_and_gradients_on_mesh, random_batch, small_config

SETTINGS = ("bfloat16", "float32")
# The weights whose gradients follow the setting (those of `weight_matmul`); the embedding and
# the norms' scales are reduced in float32 whatever it is.
FOLLOWING = ("blocks/attn/q", "blocks/attn/k", "blocks/attn/v", "blocks/attn/o",
             "blocks/mlp/gate", "blocks/mlp/up", "blocks/mlp/down", "head")
RNG = np.random.default_rng(0)


def by_name(tree) -> dict:
    """{"blocks/attn/q": leaf, ...}"""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in flat}


def as_float64(tree) -> dict:
    return {name: np.asarray(leaf, np.float64) for name, leaf in by_name(tree).items()}


def relative_error(got, expected) -> float:
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize("spec,x_shape,w_shape,out_dtype", [
    ("btd,dnh->btnh", (2, 3, 8), (8, 2, 4), None),  # attention's q, k, v
    ("btnh,nhd->btd", (2, 3, 2, 4), (2, 4, 8), None),  # its output projection
    ("becd,edf->becf", (2, 3, 4, 8), (3, 8, 5), None),  # MoE experts
    ("...d,dv->...v", (2, 3, 8), (8, 7), jnp.float32),  # the head's float32 logits
])
def test_weight_matmul_gradients_are_plain_autodiffs_in_float32(spec, x_shape, w_shape,
                                                                out_dtype):
    """In float32 the custom backward pass is exactly what autodiff of the einsum gives."""
    x = jnp.asarray(RNG.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(RNG.standard_normal(w_shape), jnp.float32)
    upstream = jnp.asarray(RNG.standard_normal(jnp.einsum(spec, x, w).shape), jnp.float32)
    ours = jax.grad(lambda x, w: jnp.sum(weight_matmul(spec, x, w, out_dtype) * upstream),
                    argnums=(0, 1))(x, w)
    plain = jax.grad(lambda x, w: jnp.sum(jnp.einsum(spec, x, w) * upstream), argnums=(0, 1))(x, w)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_weight_gradient_comes_in_the_weights_dtype_the_inputs_in_the_compute_dtype():
    x = jnp.ones((2, 3, 8), jnp.bfloat16)
    for dtype in (jnp.float32, jnp.bfloat16):
        w = jnp.ones((8, 5), dtype)
        out, vjp = jax.vjp(lambda x, w: weight_matmul("btd,df->btf", x, w), x, w)
        grad_x, grad_w = vjp(jnp.ones_like(out))
        assert (out.dtype, grad_x.dtype, grad_w.dtype) == (jnp.bfloat16, jnp.bfloat16, dtype)


@pytest.mark.parametrize("setting", SETTINGS)
def test_float32_reduction_sums_a_sharded_weight_gradient_exactly(setting):
    """One weight's gradient over rows split 8 ways (data=8), from bfloat16 activations and
    upstream gradients, whose products float32 holds exactly: reduced in float32 it is the float64
    sum to float32's precision; in bfloat16 each device's partial sum, and so the total, is off by
    bfloat16 rounding (8 significand bits: about 2^-9 relative)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = NamedSharding(mesh, P("data"))
    x = jax.device_put(jnp.asarray(RNG.standard_normal((64, 32)), jnp.bfloat16), rows)
    upstream = jax.device_put(jnp.asarray(RNG.standard_normal((64, 16)), jnp.bfloat16), rows)
    w = jnp.zeros((32, 16), setting)

    @jax.jit
    def weight_gradient(x, w, upstream):
        return jax.vjp(lambda w: weight_matmul("bd,df->bf", x, w), w)[1](upstream)[0]

    got = np.asarray(weight_gradient(x, w, upstream), np.float64)
    exact = np.asarray(x, np.float64).T @ np.asarray(upstream, np.float64)
    error = relative_error(got, exact)
    if setting == "float32":
        assert error < 1e-6
    else:
        assert 1e-4 < error < 2 ** -8


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    """{setting: gradients at data=8 with bfloat16 compute}, and the float32 reference: jax.grad of
    the mean cross-entropy written here, float32 throughout, on one device."""
    config = small_config(data=8)
    config.precision.compute_dtype = "bfloat16"
    batch = random_batch(config)
    found = {}
    for setting in SETTINGS:
        config.precision.grad_reduce_dtype = setting
        found[setting] = as_float64(loss_and_gradients_on_mesh(
            config, tmp_path_factory.mktemp(setting), batch).grads)

    config.precision.compute_dtype = "float32"
    graphdef, params = nnx.split(create_model(model_config(config), config.train.seed))

    @jax.jit
    def reference(params):
        def mean_loss(p):
            logits = nnx.merge(graphdef, p)(batch["inputs"], batch["positions"],
                                            batch["segment_ids"])
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return jnp.sum(losses * batch["loss_mask"]) / jnp.sum(batch["loss_mask"])
        return jax.grad(mean_loss)(params)
    return found, as_float64(nnx.to_pure_dict(reference(params)))


def test_each_setting_meets_bfloat16_computes_tolerance_and_float32_is_closer(gradients):
    """Both settings compute in bfloat16, which bounds how close either gets to float32 (a few
    2^-9 roundings through two layers: 2% relative); float32 reduction adds none of its own, so
    it is closer on every weight that follows the setting, and the same on the others."""
    found, reference = gradients
    assert set(FOLLOWING) < set(reference)
    for name, expected in reference.items():
        errors = {s: relative_error(found[s][name], expected) for s in SETTINGS}
        assert max(errors.values()) < 2e-2, (name, errors)
        if name in FOLLOWING:
            assert errors["float32"] < errors["bfloat16"], (name, errors)
            # The settings differ by bfloat16 rounding of the reduced gradient.
            assert relative_error(found["bfloat16"][name], found["float32"][name]) > 1e-3, name
        else:
            np.testing.assert_array_equal(found["bfloat16"][name], found["float32"][name])


# An instruction of a gradient reduction in HLO text: its result type(s) and its kind.
REDUCTION = re.compile(r"=\s*(.*?)\s(?:all-reduce|reduce-scatter)(?:-start)?\(")
SHAPE = re.compile(r"\b(bf16|f32)\[([\d,]*)\]")


def reduced_dtypes(hlo: str) -> dict[tuple[int, ...], set[str]]:
    """{operand shape without leading 1s: the element types it is reduced in}."""
    found: dict[tuple[int, ...], set[str]] = {}
    for line in hlo.splitlines():
        if m := REDUCTION.search(line):
            for dtype, dims in SHAPE.findall(m.group(1)):
                shape = tuple(int(d) for d in dims.split(",") if d)
                while shape[:1] == (1,):
                    shape = shape[1:]
                found.setdefault(shape, set()).add(dtype)
    return found


@pytest.mark.parametrize("setting,hlo_dtype", [("bfloat16", "bf16"), ("float32", "f32")])
def test_tpu_program_reduces_the_gradients_in_the_chosen_dtype(setting, hlo_dtype):
    """The train step compiled by the TPU compiler for 8 chips at data=8 with bfloat16 compute:
    each attention, feed-forward and head weight's gradient is all-reduced in the setting's
    dtype, the embedding's in float32 either way. (XLA:CPU widens every bfloat16 collective to
    float32, so the CPU program cannot show this.)"""
    config = small_config(data=8)
    config.precision.update(compute_dtype="bfloat16", grad_reduce_dtype=setting)
    compiled, _ = compile_train_step(config, target_devices(parse_target("v5p:2x2x2")))
    reduced = reduced_dtypes(compiled.as_text())
    shapes = by_name(nnx.to_pure_dict(nnx.split(abstract_model(model_config(config)))[1]))
    for name in FOLLOWING:
        # A layer's weights are reduced one layer at a time in the loop over layers, or stacked
        # after it.
        shape = shapes[name].shape
        layer = shape[1:] if name.startswith("blocks/") else shape
        dtypes = reduced.get(shape, set()) | reduced.get(layer, set())
        assert dtypes == {hlo_dtype}, (name, shape, reduced)
    assert reduced[shapes["embed"].shape] == {"f32"}


def test_an_unknown_reduction_dtype_is_a_config_error():
    config = small_config()
    config.precision.grad_reduce_dtype = "float16"
    with pytest.raises(ConfigError, match=r"precision.grad_reduce_dtype='float16' is unknown; "
                                          r"use 'float32' or 'bfloat16'"):
        check_settings(config)


@pytest.mark.parametrize("remat", ["full", pytest.param("save_dots", marks=pytest.mark.slow)])
def test_remat_policies_keep_the_float32_reduced_gradients(remat):
    """bfloat16 compute, float32 reduction: the policies recompute through the custom backward
    pass to the same loss and gradients (tests/test_layers.py counts what save_dots keeps)."""
    config = small_config()
    config.precision.update(compute_dtype="bfloat16", grad_reduce_dtype="float32")
    tokens = jnp.asarray(RNG.integers(3, 259, (2, 8)))

    def loss_and_grads(cfg):
        graphdef, params = nnx.split(create_model(model_config(cfg), 0))
        def loss(p):
            return jnp.sum(nnx.merge(graphdef, p)(tokens) ** 2) * 1e-3
        return jax.jit(jax.value_and_grad(loss))(params)

    baseline = loss_and_grads(config)
    config.model.remat = remat
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 loss_and_grads(config), baseline)


def _stack_loss_and_grads(config, batch):
    """(the summed loss, its gradient) of `config`'s model on one device, and the jaxpr of the
    gradient."""
    graphdef, params = nnx.split(create_model(model_config(config), 0))
    grad_fn = jax.value_and_grad(lambda p: Objective(graphdef).summed_loss(Weights(p), batch)[0])
    return jax.jit(grad_fn)(params), jax.make_jaxpr(grad_fn)(params)


def _scans(jaxpr) -> list:
    """Every scan in `jaxpr` and the jaxprs nested in it, in program order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _scans(sub)
    return found


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_layer_loop_stacks_the_weights_gradients_in_their_reduction_dtype(setting,
                                                                             monkeypatch):
    """`weights_cast_for_use` casts a stack's weights before the layer loop, so the loop's
    gradient of them is stacked in the dtype it is made in (bfloat16 here: half the memory of
    float32) and widened after the loop: the same loss and gradients, bit for bit, as the cast
    inside the loop (the stack passed on uncast)."""
    config = small_config()
    config.precision.update(compute_dtype="bfloat16", grad_reduce_dtype=setting)
    batch = random_batch(config)
    (loss, grads), jaxpr = _stack_loss_and_grads(config, batch)
    monkeypatch.setattr(decoder, "weights_cast_for_use", lambda module, state: state)
    (loss_inside, grads_inside), jaxpr_inside = _stack_loss_and_grads(config, batch)

    assert loss == loss_inside
    for name, leaf in by_name(nnx.to_pure_dict(grads)).items():
        np.testing.assert_array_equal(leaf, by_name(nnx.to_pure_dict(grads_inside))[name])
        assert leaf.dtype == jnp.float32, name  # the optimizer's gradients stay float32
    m = config.model
    stacked_gate = (m.n_layers, m.d_model, m.mlp_dim)

    def gradient_dtypes(j):
        """The dtypes of the stacked gate-shaped outputs of the backward pass's layer loop (the
        last scan; the forward's comes first)."""
        return {v.aval.dtype.name for v in _scans(j.jaxpr)[-1].outvars
                if v.aval.shape == stacked_gate}
    assert gradient_dtypes(jaxpr) == {setting}
    assert gradient_dtypes(jaxpr_inside) == {"float32"}


def test_only_the_weights_cast_where_they_are_used_are_cast_before_the_loop():
    """float32 reduction, bfloat16 compute: the attention and dense feed-forward weights stay
    float32 (their gradient dtype), the MoE experts go to the compute dtype; the norms' scales
    and the router stay float32, as their layers use them."""
    config = small_config()
    config.precision.update(compute_dtype="bfloat16", grad_reduce_dtype="float32")
    config.model.moe.update(experts=4, top_k=2, every=2)  # layer 1 of the group is MoE
    model = create_model(model_config(config), 0)
    state = nnx.split(model.blocks)[1]
    cast = by_name(nnx.to_pure_dict(weights_cast_for_use(model.blocks, state)))
    experts = {f"layers/1/mlp/{w}" for w in ("gate", "up", "down")}
    assert experts < set(cast) and "layers/1/mlp/router" in cast
    for name, leaf in cast.items():
        assert leaf.dtype == (jnp.bfloat16 if name in experts else jnp.float32), name


def test_fp8_matmuls_weights_are_not_cast_before_the_loop():
    """With fp8 matmuls every attention and feed-forward weight stays float32 before the loop:
    its matmul quantizes it in the layer (one rounding, not two)."""
    config = small_config()
    config.precision.update(compute_dtype="bfloat16", matmul="fp8")
    model = create_model(model_config(config), 0)
    state = nnx.split(model.blocks)[1]
    cast = by_name(nnx.to_pure_dict(weights_cast_for_use(model.blocks, state)))
    weights = [name for name in cast if name.rsplit("/", 1)[-1] in ("q", "k", "v", "o", "gate",
                                                                     "up", "down")]
    assert len(weights) == 7
    for name in weights:
        assert cast[name].dtype == jnp.float32, name


def test_the_train_step_takes_a_stacks_gradient_in_the_dtype_it_was_made_in():
    """With `made_dtypes` the step's gradient of a stack's weights cast before the loop comes
    in the compute dtype (what the streamed update widens a layer at a time), every other leaf
    in its parameter's dtype; widened, it is the float32 gradient bit for bit."""
    config = small_config()
    config.precision.update(compute_dtype="bfloat16", grad_reduce_dtype="bfloat16")
    graphdef, params = nnx.split(create_model(model_config(config), 0))
    params = nnx.to_pure_dict(params)
    batch = random_batch(config)
    grads = {made: by_name(jax.jit(lambda p, made=made: Objective.of(config, graphdef, None)
                                   .forward_backward(Weights(p), batch, jnp.float32(1e-2),
                                                     made_dtypes=made).grads)(params))
        for made in (False, True)}
    cast = {f"blocks/{w}" for w in ("attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate",
                                    "mlp/up", "mlp/down")}
    for name, leaf in grads[True].items():
        assert leaf.dtype == (jnp.bfloat16 if name in cast else jnp.float32), name
        assert grads[False][name].dtype == jnp.float32
        np.testing.assert_array_equal(leaf.astype(jnp.float32), grads[False][name])
    assert cast < set(grads[True])
