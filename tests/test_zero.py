"""ZeRO-1 (`sharding.optimizer_state=data`): where the optimizer state lives, that the compiled
program reduce-scatters the gradients onto it, that it trains like the replicated optimizer, and
that its state restores into the other layout."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.checkpoint import Checkpoints
from jaxscale.checks import validate
from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.models.spec import model_spec
from jaxscale.parallel.sharding import rules_from_config, spec_axes, split_further
from jaxscale.plan.collectives import bytes_by_kind, parse_collectives
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.targets import parse_target, target_devices
from jaxscale.trainer import Trainer
from jaxscale.training.layout import StateLayout
from tests.helpers import random_batch, small_config


def test_split_further_adds_the_unused_axes_to_the_first_dimension_they_divide():
    mesh_shape = dict(data=2, fsdp=4, tensor=1)
    on_fsdp = P(None, "fsdp")
    both = ("data", "fsdp", "tensor")
    assert split_further(on_fsdp, (6, 8), both, mesh_shape) == P("data", "fsdp")
    assert split_further(on_fsdp, (3, 8), both, mesh_shape) == P(None, ("fsdp", "data"))
    assert split_further(on_fsdp, (3, 4), both, mesh_shape) is None  # 4 % (4 * 2) != 0
    assert split_further(on_fsdp, (3, 4), ("fsdp",), mesh_shape) is on_fsdp  # nothing to add


def data_dimension(spec: P) -> int | None:
    return next((dim for dim, entry in enumerate(spec) if "data" in spec_axes(entry)), None)


def test_zero1_splits_stacked_parameters_within_a_layer():
    """A stacked parameter [layers, ...] is split over the data axis along one of its own
    dimensions, never along `layers` (which the data degree divides here too); one whose own
    dimensions it divides none of is a config error."""
    config = small_config(data=4)
    config.model.n_layers = 4
    rules = rules_from_config(config.sharding.rules)
    mesh_shape = dict(data=4, pipeline=1, fsdp=1, context=1, expert=1, tensor=1)
    moments = StateLayout(model_spec(config), rules, mesh_shape, "data", False).moments
    blocks = moments["blocks"]
    assert data_dimension(blocks["attn"]["q"]) == 1  # [layers, embed=64, heads=4, head_dim]
    assert data_dimension(blocks["mlp"]["down"]) == 1  # [layers, mlp=128, embed=64]
    assert data_dimension(blocks["attn_norm"]["scale"]) == 1  # [layers, embed=64]
    assert data_dimension(moments["embed"]) == 0  # [vocab=384, embed=64]: no layers dimension

    config.model.update(d_model=34, n_heads=2, n_kv_heads=2)  # head_dim 16: q and k still split
    with pytest.raises(ConfigError, match=r"'blocks/attn_norm/scale' \[4, 34\] has no dimension "
                                          "besides its stacked layers divisible by the "
                                          "data-parallel degree data=4"):
        StateLayout(model_spec(config), rules, mesh_shape, "data", False)


def test_zero1_program_reduce_scatters_the_gradients_over_data():
    """Compiled for a TPU slice (data=4, bfloat16 compute), the gradients leave the layer loop
    reduce-scattered: a reduce-scatter per layer and weight, and all-reduces only of scalars and
    norm scales. With the state split by layer (4 layers, data=4) each layer's gradients were
    all-reduced whole inside the loop and sliced after it."""
    config = small_config(data=4)
    config.precision.compute_dtype = "bfloat16"
    config.model.update(n_layers=4, d_model=128, mlp_dim=256, head_dim=64)
    config.train.update(batch_size=8, seq_len=64)
    config.sharding.optimizer_state = "data"
    compiled, _ = compile_train_step(config, target_devices(parse_target("v5p:2x2x1")))
    found = parse_collectives(compiled.as_text(), dict(data=4, fsdp=1))
    reductions = [c for c in found if c.kind in ("reduce-scatter", "all-reduce")]
    assert {c.axes for c in reductions} == {("data",)}
    moved = bytes_by_kind(found)
    # Every gradient goes through a reduce-scatter: the layers' in bfloat16 (their products'
    # dtype), the embedding's and head's in float32.
    assert moved["reduce-scatter"] >= 2 * model_spec(config).num_params
    assert moved["all-reduce"] <= 0.01 * moved["reduce-scatter"]
    assert sum(c.count for c in found if c.kind == "reduce-scatter") >= config.model.n_layers


def optimizer_bytes_per_device(state):
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(state.opt_state))


def three_steps(layout, tmp_path, **mesh):
    config = small_config(**mesh)
    config.sharding.optimizer_state = layout
    config.checkpoint.compilation_cache = False
    trainer = Trainer(config, str(tmp_path / layout))
    state, losses = trainer.program.init_state(0), []
    for seed in range(3):
        batch = jax.device_put(random_batch(config, seed), trainer.program.batch_sharding)
        state, metrics = trainer.program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return trainer, state, losses


@pytest.mark.parametrize("mesh, fraction", [
    (dict(data=8), 1 / 8),  # pure data parallelism: the state split 8 ways
    # HSDP's layout: already split over fsdp, now over data too (within each of the 2 layers)
    (dict(data=2, fsdp=4), 1 / 2),
])
@pytest.mark.slow
def test_zero1_trains_like_the_unsharded_optimizer_on_a_fraction_of_the_bytes(tmp_path, mesh,
                                                                              fraction):
    _, reference, expected = three_steps("params", tmp_path, **mesh)
    trainer, state, losses = three_steps("data", tmp_path, **mesh)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    # Summed in another order, a near-zero gradient differs in its last bits, and AdamW divides by
    # its root mean square: a weight (~0.02) can move by 5e-7 more in 3 steps (seen on jax 0.12).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 jax.device_get(state.params), jax.device_get(reference.params))
    ratio = optimizer_bytes_per_device(state) / optimizer_bytes_per_device(reference)
    assert ratio == pytest.approx(fraction, rel=0.02)  # the step counters stay replicated
    # The parameters keep their own layout.
    assert jax.tree.map(lambda x: x.sharding, state.params) == jax.tree.map(
        lambda x: x.sharding, reference.params)


@pytest.mark.slow  # trains, saves and restores across layouts (about 13 s)
def test_zero1_state_restores_into_the_other_layout(tmp_path):
    trainer, state, _ = three_steps("data", tmp_path, data=8)
    with Checkpoints(trainer.config, str(tmp_path / "run")) as checkpoints:
        checkpoints.save(3, state, {}, {"step": 3})
    config = small_config(data=8)
    config.checkpoint.compilation_cache = False
    other = Trainer(config, str(tmp_path / "run"))  # optimizer_state="params"
    with Checkpoints(config, str(tmp_path / "run")) as checkpoints:
        restored = checkpoints.restore_newest(other.program.abstract_state)
    jax.tree.map(np.testing.assert_array_equal, restored.train["opt_state"],
                 jax.device_get(state.opt_state))
    restored_layout = [x.sharding for x in jax.tree.leaves(restored.train["opt_state"])]
    assert restored_layout == jax.tree.leaves(other.program.state_shardings.opt_state)


def test_zero1_that_cannot_split_a_parameter_is_one_config_error():
    config = small_config(data=8)
    config.model.update(d_model=36, head_dim=18, mlp_dim=72)  # norm scales [2, 36]: 8 divides none
    config.sharding.optimizer_state = "data"
    with pytest.raises(ConfigError) as error:
        validate(config, 8)  # what the trainer and launch.fit check before anything starts
    message = str(error.value)
    assert "\n" not in message
    assert "no dimension besides its stacked layers divisible by the data-parallel degree " \
           "data=8" in message
    assert "sharding.optimizer_state='params'" in message


def test_an_unknown_optimizer_state_layout_is_a_config_error():
    config = small_config(data=8)
    config.sharding.optimizer_state = "zero3"
    with pytest.raises(JaxscaleError, match="sharding.optimizer_state='zero3' is unknown"):
        validate(config, 8)
