"""Where LoRA's adapters live (jaxscale/training/layout.py `StateLayout`): each factor is also split
over the data-parallel axes its weight is split over (FSDP), so a device holds 1/fsdp of every
factor, its gradient and its Adam moments; the mesh still trains as one device does, ZeRO-1 starts
from that layout, and the planner's memory model counts it as the compiled step holds it."""

import functools
import math

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.checks import checked_mesh
from jaxscale.cli import load_config_file
from jaxscale.models.lora import split_adapters
from jaxscale.models.spec import model_spec
from jaxscale.parallel.sharding import logical_to_mesh, rules_from_config, spec_axes
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.memory_model import estimate_memory
from jaxscale.training.layout import StateLayout
from jaxscale.training.program import TrainProgram
from tests.helpers import mesh_devices, random_batch, small_config

UNSPLIT = dict(data=1, fsdp=1, tensor=1, pipeline=1, expert=1, context=1)


def lora_config(**mesh):
    """small_config with rank-4 adapters on every target."""
    c = small_config(**mesh)
    c.model.lora.update(rank=4, alpha=8.0)
    return c


@functools.cache
def program_on(layout: str, **mesh) -> TrainProgram:
    """The program of `lora_config(**mesh)` with sharding.optimizer_state=`layout`, built once
    (the tests that read its shardings and those that train share its compiled init)."""
    config = lora_config(**mesh)
    config.sharding.optimizer_state = layout
    return TrainProgram(config, checked_mesh(config, mesh_devices(config)))


def adapter_entries(tree):
    """{"blocks/attn/q_lora/a": leaf, ...} of a params-shaped tree's adapters."""
    leaves = jax.tree_util.tree_leaves_with_path(
        split_adapters(tree)[0], is_leaf=lambda x: isinstance(x, P))
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in leaves}


def axes_of(spec) -> set[str]:
    return {a for entry in spec for a in spec_axes(entry)}


def test_each_factor_takes_its_weights_data_parallel_axes_and_no_others():
    """Spec-level, on mesh shapes alone: B of q gets fsdp (from q's `embed`) on its first
    dimension within a layer that fsdp divides, A of q keeps what it had; the tensor and pipeline
    axes are never added; where no dimension divides, the factor keeps its plain spec."""
    config = lora_config()
    spec, rules = model_spec(config), rules_from_config(config.sharding.rules)
    mesh_shape = UNSPLIT | dict(fsdp=4, tensor=2, pipeline=2)
    plain = {k: logical_to_mesh(v, rules) for k, v in adapter_entries(spec.logical_specs).items()}
    split = adapter_entries(StateLayout(spec, rules, mesh_shape, "params", False).params)
    assert split["blocks/attn/q_lora/a"] == plain["blocks/attn/q_lora/a"]  # [layers, embed, r]
    # [layers, r=4, heads=4, head_dim]: the rank is the first dimension fsdp=4 divides.
    assert split["blocks/attn/q_lora/b"] == P("pipeline", "fsdp", "tensor", None)
    # [layers, heads=4, head_dim=16, r]: heads split over tensor x fsdp = 8 does not divide 4.
    assert split["blocks/attn/o_lora/a"] == P("pipeline", "tensor", "fsdp", None)
    for name, s in split.items():
        assert axes_of(s) - axes_of(plain[name]) <= {"fsdp"}, name
        assert "fsdp" in axes_of(s), name  # every factor here has a dimension fsdp divides
    # The base is untouched.
    assert (StateLayout(spec, rules, mesh_shape, "params", False).params["blocks"]["attn"]["q"]
            == logical_to_mesh(spec.logical_specs["blocks"]["attn"]["q"], rules))

    # fsdp=32 divides no dimension of B of k [layers, r=4, kv_heads=2, head_dim=16]: it stays as
    # it was; B of gate [layers, 4, mlp=128] is split on mlp (with the tensor axis of its rule).
    wide = adapter_entries(
        StateLayout(spec, rules, UNSPLIT | dict(fsdp=32), "params", False).params)
    assert wide["blocks/attn/k_lora/b"] == plain["blocks/attn/k_lora/b"]
    assert wide["blocks/mlp/gate_lora/b"] == P("pipeline", None, ("tensor", "fsdp"))


@pytest.mark.parametrize("mesh", [dict(fsdp=4, tensor=2), dict(fsdp=8)],
                         ids=["fsdp4-tensor2", "fsdp8"])
def test_each_device_holds_one_fsdp_th_of_every_factor_and_of_its_moments(mesh):
    """Read from the program's state shardings (the arrays are born so: see
    `test_split_adapters_train_as_one_device_does`): a factor of S elements whose rule splits it
    over other axes (tensor) K ways has S / (K fsdp) of them on a device, whether its rule named
    fsdp (A of q: `embed`) or not (B of q); Adam's moments are cut as their parameter."""
    program = program_on("params", **mesh)
    rules, fsdp, state = program.rules, mesh["fsdp"], program.abstract_state
    plain = adapter_entries(program.model.logical_specs)
    abstract = adapter_entries(state.params)
    assert set(abstract) == set(plain) and len(plain) == 14  # 7 targets x (a, b)
    for name, logical in plain.items():
        shape = abstract[name].shape
        others = math.prod(program.mesh.shape[a]
                           for a in axes_of(logical_to_mesh(logical, rules)) - {"fsdp"})
        whole = math.prod(shape) // others  # what a device would hold without fsdp
        assert math.prod(abstract[name].sharding.shard_shape(shape)) * fsdp == whole, name

    def same_cut(moment, param):
        return moment.sharding.shard_shape(moment.shape) == param.sharding.shard_shape(param.shape)
    cut = optax.tree_map_params(program.tx, same_cut, state.opt_state, state.params,
                                transform_non_params=lambda _: True)
    verdicts = jax.tree.leaves(cut)
    assert len(verdicts) >= 2 * len(plain) and all(verdicts)


def shard_shapes(tree):
    return jax.tree.map(lambda x: x.sharding.shard_shape(x.shape), tree)


def steps_on(program, count=2):
    """Losses of `count` train steps of one batch from the init (B made nonzero, so every factor
    has a gradient), the adapters after them, and the state."""
    config = program.config
    state = program.init_state(0)
    # Every array is born as the program's shardings say: the adapters split, and their moments.
    assert shard_shapes(state) == shard_shapes(program.abstract_state)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: (0.05 * jax.random.normal(next(keys), x.shape, x.dtype)
                         if path[-1].key == "b" else x), jax.device_get(state.params))
    state = state._replace(params=jax.device_put(adapters, program.state_shardings.params))
    batch = jax.device_put(random_batch(config), program.batch_sharding)
    losses = []
    for _ in range(count):
        state, metrics = program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state.params), state


@functools.cache
def one_device():
    return steps_on(program_on("params"))[:2]


@pytest.mark.parametrize("mesh", [pytest.param(dict(fsdp=4, tensor=2), marks=pytest.mark.slow),
                                  pytest.param(dict(fsdp=8), marks=pytest.mark.slow),
                                  dict(data=2, fsdp=4, optimizer_state="data")],
                         ids=["fsdp4-tensor2", "fsdp8", "zero1-data2-fsdp4"])
def test_split_adapters_train_as_one_device_does(mesh):
    """Losses and the adapters after two steps (tolerances of tests/test_lora.py). With
    sharding.optimizer_state='data' (ZeRO-1) the moments start from the split factors and are
    also split over `data`."""
    mesh = dict(mesh)
    layout = mesh.pop("optimizer_state", "params")
    program = program_on(layout, **mesh)
    if layout == "data":
        spec, rules = program.model, program.rules
        mesh_shape = dict(program.mesh.shape)
        moments = adapter_entries(StateLayout(spec, rules, mesh_shape, "data", False).moments)
        params = adapter_entries(StateLayout(spec, rules, mesh_shape, "params", False).params)
        assert moments.keys() == params.keys() and "fsdp" in axes_of(params["blocks/attn/q_lora/b"])
        for name, s in moments.items():
            assert axes_of(params[name]) | {"data"} == axes_of(s), name
    losses, adapters, state = steps_on(program)
    one_losses, one_adapters = one_device()
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 adapters, one_adapters)
    if layout == "params":
        # Evaluation reads the whole model, base and split adapters, as the state holds them
        # (jit refuses arguments laid out otherwise than its in_shardings).
        loss, tokens = program.eval_step(state.model_params(),
                                         jax.device_put(random_batch(program.config),
                                                        program.batch_sharding))
        assert np.isfinite(float(loss / tokens))


def bytes_per_device(abstract, shardings) -> int:
    """What the arrays of `abstract` (scalars aside) take on one device, cut as `shardings` says."""
    return sum(math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
               for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)) if a.ndim)


@pytest.mark.parametrize("mesh", [dict(fsdp=4, tensor=2), dict(fsdp=8)],
                         ids=["fsdp4-tensor2", "fsdp8"])
def test_the_memory_model_counts_the_state_as_the_program_holds_it(mesh):
    """The planner's estimate of the parameters (float32 adapters, the frozen base) and the
    moments is, byte for byte, what the program's state shardings put on a device: the adapters'
    split is counted as the state holds it (nothing compiled)."""
    program = program_on("params", **mesh)
    state, shardings = program.abstract_state, program.state_shardings
    estimate = estimate_memory(program.config, program.model, dict(program.mesh.shape), "xla")
    assert estimate.params == (bytes_per_device(state.params, shardings.params)
                               + bytes_per_device(state.frozen, shardings.frozen))
    assert estimate.moments == bytes_per_device(state.opt_state, shardings.opt_state)
    # ... and a device's adapters and moments are 1/fsdp of what they would be without fsdp.
    unsplit = estimate_memory(program.config, program.model,
                              dict(program.mesh.shape) | {"fsdp": 1}, "xla")
    assert estimate.moments * mesh["fsdp"] == unsplit.moments


@pytest.mark.slow
@pytest.mark.parametrize("remat, dropout", [("full", 0.0), ("full", 0.1), ("none", 0.1)])
def test_the_memory_estimate_of_a_lora_step_is_within_25_percent_of_the_compiler(remat, dropout):
    """configs/tiny.py with rank-16 adapters, bfloat16, fsdp=8, on the 8 CPU devices. The
    estimate's state and batch are the compiled step's arguments to within the scalars (step,
    loss scale, Adam's counts: under 64 bytes), so the adapters' split is counted as the program
    holds it; the total is within 25% of the compiler's, the bound of tests/test_plan.py
    (measured 0.997; with dropout, whose dropped inputs and masks it counts, 0.85 with remat full
    and 0.90 with none, where uncounted they gave 0.73). On the TPU compiler, benchmarks/lora.py's
    LoRA side reads 2.38 GiB estimated against 1.77 compiled: the activations' term over-counts
    there, for full fine-tuning by as many bytes (7.51 against 6.92)."""
    config = load_config_file("configs/tiny.py")
    config.checkpoint.enabled = False
    config.train.update(steps=2, batch_size=8)
    config.mesh.update(data=1, fsdp=8, tensor=1)
    config.model.update(remat=remat)
    config.model.lora.update(rank=16, alpha=16.0, dropout=dropout)
    config.precision.compute_dtype = "bfloat16"
    _, memory = compile_train_step(config, jax.devices()[:8])
    estimate = estimate_memory(config, model_spec(config), UNSPLIT | dict(fsdp=8), "xla")
    assert 0 <= memory.arguments - (estimate.params + estimate.moments + estimate.batch) < 64
    assert 0.75 <= estimate.total / memory.total <= 1.25, (estimate, memory)


def lora_moe_config(compute_dtype: str, remat: str, targets=("q", "v", "gate", "up", "down")):
    """configs/tiny_moe.py (4 layers of 8 experts, d_model 256, width 384) with rank-8 adapters,
    batch 8, on data=2 x expert=4."""
    config = load_config_file("configs/tiny_moe.py")
    config.checkpoint.enabled = False
    config.train.update(steps=2, batch_size=8)
    config.mesh.update(data=2, fsdp=1, tensor=1, expert=4)
    config.model.update(remat=remat)
    config.model.lora.update(rank=8, alpha=16.0, targets=targets)
    config.precision.compute_dtype = compute_dtype
    return config


@pytest.mark.parametrize("remat", ["full", "none"])
def test_the_memory_model_counts_the_experts_folded_weights(remat):
    """Against the closed form: each device holds 2 of a layer's 8 experts, whose gate, up and
    down weights (3 x 256 x 384 each) are folded in float32 one layer at a time, and without
    remat kept for the backward in bfloat16 for all 4 layers; adapters on attention alone fold
    nothing."""
    mesh = UNSPLIT | dict(data=2, expert=4)
    config = lora_moe_config("bfloat16", remat)
    estimate = estimate_memory(config, model_spec(config), mesh, "xla")
    layer = 2 * 3 * 256 * 384
    assert estimate.folded_experts == layer * 4 + (4 * layer * 2 if remat == "none" else 0)
    config = lora_moe_config("bfloat16", remat, targets=("q", "up"))
    assert estimate_memory(config, model_spec(config), mesh, "xla").folded_experts == (
        estimate.folded_experts // 3)
    config = lora_moe_config("bfloat16", remat, targets=("q", "v"))
    assert estimate_memory(config, model_spec(config), mesh, "xla").folded_experts == 0


@pytest.mark.slow
def test_the_memory_estimate_of_a_lora_mixture_step_is_within_25_percent_of_the_compiler():
    """LoRA on a mixture's experts, bfloat16, remat full, data=2 x expert=4 on the 8 CPU devices:
    the estimate is within 25% of the compiler's (measured 0.82; 0.74 with the folded weights
    uncounted, which this bound sees)."""
    config = lora_moe_config("bfloat16", "full")
    _, memory = compile_train_step(config, jax.devices()[:8])
    estimate = estimate_memory(config, model_spec(config), UNSPLIT | dict(data=2, expert=4),
                               "xla")
    assert 0.75 <= estimate.total / memory.total <= 1.25, (estimate, memory)
