"""Expert parallelism: moving an MoE layer's dispatched tokens to their experts' devices and back.

The `experts` logical axis (the experts of a layer) is split over the mesh axes of the `experts`
rule; the `batch` rule splits the rows over the same axes too (default ("data", "fsdp",
"expert")), so the attention and other dense parts of the model are data-parallel over them and
never replicated. An MoE layer dispatches each row's tokens into buffers [batch, experts,
capacity, d_model] where the row lives (the token layout: rows split over the expert axes, every
expert's slots present). The experts' matmuls need the opposite (the expert layout: each device
holds its own experts' slots, of the rows of its whole expert group), so `to_experts` swaps the
two with one all-to-all over the expert axes, inside `shard_map`, and `to_tokens` swaps them
back: each device sends every other one the slots that its experts hold and receives its own
experts' slots of the other devices' rows.

Dropless MoE (`model.moe.capacity_factor=0`) moves weights, not tokens: `on_token_shards` runs
the grouped matmuls inside `shard_map` on each device's own rows and positions (the `batch` and
`length` rules), with the layer's expert weights gathered whole on every device (an all-gather of
(degree - 1) / degree of 3 x experts x d_model x mlp_dim compute-dtype values per device and
layer; their gradients come back by a reduce-scatter of the same size). The token exchange a
dropless all-to-all needs has per-device sizes known only at run time (`ragged_all_to_all`),
which XLA's CPU backend does not implement; a fixed-size all-to-all would have to reserve every
expert a slot for every token (experts / top_k times the assignments' bytes). Each device still
computes only its own tokens' top_k experts, and the parameters and optimizer state stay split.

Model code names logical axes only: `to_experts(x, logical)`, `to_tokens`, `constrain_experts`,
`on_token_shards`; without active rules (a plain call of the model) they return x unchanged or
call the function as is.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError
from jaxscale.parallel.sharding import Rules, active_mesh_and_rules, logical_to_mesh, spec_axes


def _expert_first(rules: Rules) -> Rules:
    """The rules with the expert axes taken off every other logical axis: in the expert layout
    the experts hold them, so e.g. `batch` splits only over its other axes."""
    taken = set(rules.get("experts", ()))
    return {name: axes if name == "experts" else tuple(a for a in axes if a not in taken)
            for name, axes in rules.items()}


def _layouts(logical: Sequence[str | None], rules: Rules) -> tuple[P, P, tuple[str, ...]]:
    """(token spec, expert spec, expert axes) of an array with these logical axes (one `batch`
    and one `experts` among them). In the token spec the expert axes split `batch` last (minor),
    which makes the all-to-all's concatenated blocks of rows come out in the rows' order."""
    experts = tuple(rules.get("experts", ()))
    expert_spec = logical_to_mesh(logical, _expert_first(rules))
    token_spec = list(expert_spec)
    token_spec[logical.index("experts")] = None
    token_spec[logical.index("batch")] = spec_axes(expert_spec[logical.index("batch")]) + experts
    return P(*token_spec), expert_spec, experts


def _exchange(x: jax.Array, logical: Sequence[str | None], to_experts: bool) -> jax.Array:
    active = active_mesh_and_rules()
    if active is None:
        return x
    mesh, rules = active
    token_spec, expert_spec, experts = _layouts(logical, rules)
    degree = math.prod(mesh.shape[a] for a in experts)
    batch, expert = logical.index("batch"), logical.index("experts")
    rows = math.prod(mesh.shape[a] for a in spec_axes(token_spec[batch]))
    if degree == 1 or x.shape[batch] % rows or x.shape[expert] % degree:
        # Nothing to exchange, or rows that do not split evenly (a decoding batch): the
        # constraint alone, which XLA follows where it can.
        return constrain_experts(x, logical)
    # Token layout: split experts, gather rows; back: split rows, gather experts.
    split, concat = (expert, batch) if to_experts else (batch, expert)
    in_spec, out_spec = (token_spec, expert_spec) if to_experts else (expert_spec, token_spec)
    def swap(shard):
        return jax.lax.all_to_all(shard, experts, split, concat, tiled=True)
    return jax.shard_map(swap, mesh=mesh, in_specs=in_spec, out_specs=out_spec)(x)


def to_experts(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Dispatched buffers (logical axes include `batch` and `experts`) from the token layout to
    the expert layout, by an all-to-all over the expert mesh axes."""
    return _exchange(x, logical, to_experts=True)


def to_tokens(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """The experts' outputs from the expert layout back to the token layout (`to_experts`'s
    inverse)."""
    return _exchange(x, logical, to_experts=False)


def on_token_shards(fn: Callable[..., jax.Array], tokens: Sequence[jax.Array],
                    weights: Sequence[jax.Array]) -> jax.Array:
    """`fn(*tokens, *weights)` on each device's own tokens: every array of `tokens` has the
    logical axes (`batch`, `length`, ...) and is split by their rules, as is the output; the
    weights are gathered whole. Without active rules, or with a shape the mesh does not divide
    (a decoding batch), a plain call that XLA partitions as it can."""
    active = active_mesh_and_rules()
    if active is None:
        return fn(*tokens, *weights)
    mesh, rules = active
    spec = logical_to_mesh(("batch", "length"), rules)
    sizes = [math.prod(mesh.shape[a] for a in spec_axes(entry)) for entry in spec]
    if any(x.shape[i] % size for x in tokens for i, size in enumerate(sizes)):
        return fn(*tokens, *weights)
    in_specs = (spec,) * len(tokens) + (P(),) * len(weights)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec)(*tokens, *weights)


def constrain_experts(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pins `x` to the expert layout (no-op without active rules)."""
    active = active_mesh_and_rules()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, logical_to_mesh(logical, _expert_first(rules))))


def check_experts(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """The expert mesh axis: MoE layers to split, experts it divides, and rows split over it too
    (the all-to-all of jaxscale/parallel/experts.py trades rows for experts)."""
    degree, moe = mesh_shape["expert"], config.model.moe
    if degree == 1:
        return
    where = f"mesh.expert x mesh.dcn.expert = {degree}"
    if not moe.every:
        raise ConfigError(f"{where} but the model has no MoE layers (model.moe.every=0); set "
                          "mesh.expert=1 (and mesh.dcn.expert=1), or make layers MoE")
    if moe.experts % degree:
        raise ConfigError(f"model.moe.experts={moe.experts} is not divisible by {where}; pick an "
                          f"expert degree that divides {moe.experts}")
    rules = config.sharding.rules
    experts, batch = tuple(rules.get("experts", ())), tuple(rules.get("batch", ()))
    if experts != ("expert",) or "expert" not in batch:
        raise ConfigError(f"{where} needs sharding.rules.experts=('expert',) and the expert axis "
                          f"in sharding.rules.batch (the rows trade places with the experts), got "
                          f"experts={experts} and batch={batch}")
