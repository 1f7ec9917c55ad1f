"""Parameters, optimizer state and batches are laid out by the logical rules."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxscale.parallel.sharding import logical_to_mesh
from jaxscale.trainer import Trainer
from tests.helpers import small_config

RULES = dict(batch=("data", "fsdp"), embed=("fsdp",), heads=("tensor",), kv_heads=("tensor",),
             mlp=("tensor",), vocab=("tensor",))


def test_logical_to_mesh_uses_each_mesh_axis_once():
    assert logical_to_mesh(("batch", "length", "embed"), RULES) == P(("data", "fsdp"), None, None)
    assert logical_to_mesh(("embed", "mlp"), RULES) == P("fsdp", "tensor")
    assert logical_to_mesh(("layers", "embed", "heads", "head_dim"), RULES) == P(
        None, "fsdp", "tensor", None)


def expected_shards(shape, spec, mesh_shape):
    """Shard shape implied by a PartitionSpec, computed independently of JAX."""
    out = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        div = 1
        for a in axes:
            div *= mesh_shape[a]
        out.append(size // div)
    return tuple(out)


@pytest.mark.parametrize("mesh", [dict(data=8), dict(data=2, fsdp=2, tensor=2),
                                  dict(data=1, fsdp=4, tensor=2)])
def test_state_is_born_sharded_by_the_rules(mesh, tmp_path):
    config = small_config(**mesh)
    trainer = Trainer(config, str(tmp_path))
    state = trainer.program.init_state(0)
    mesh_shape = dict(trainer.program.mesh.shape)

    wq = state.params["blocks"]["attn"]["q"]  # [layers, embed, heads, head_dim]
    assert wq.sharding.spec == logical_to_mesh(("layers", "embed", "heads", "head_dim"),
                                               trainer.program.rules)
    for path, array in jax.tree_util.tree_leaves_with_path(state.params):
        spec = array.sharding.spec
        for shard in array.addressable_shards:
            assert shard.data.shape == expected_shards(array.shape, spec, mesh_shape), path
    # Adam moments live exactly where their parameters live.
    adam = state.opt_state[1][0]
    assert adam.mu["blocks"]["mlp"]["up"].sharding == state.params["blocks"]["mlp"]["up"].sharding
    assert adam.nu["embed"].sharding == state.params["embed"].sharding
    # Nothing is left whole on one device when the rules shard it.
    if mesh_shape["fsdp"] * mesh_shape["tensor"] > 1:
        up = state.params["blocks"]["mlp"]["up"]
        assert up.addressable_shards[0].data.size < up.size
