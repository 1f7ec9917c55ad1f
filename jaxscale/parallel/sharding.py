"""Logical axis names -> mesh axes.

Model code names the axes of its parameters and activations (`embed`, `heads`, ...). A rules table
maps each logical name to the mesh axes it is split over. The trainer installs the mesh and rules
with `use_rules` (`with_rules` wraps a function in it); `constrain` then pins activations to the
resulting sharding, and is a no-op when no rules are installed (a plain single-device call of the
model).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.config import LOGICAL_AXES, MESH_AXES
from jaxscale.errors import ConfigError

Rules = Mapping[str, tuple[str, ...]]

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxscale_sharding_rules", default=None)


def rules_from_config(rules: ml_collections.ConfigDict) -> dict[str, tuple[str, ...]]:
    """The config's rules table as plain tuples (a single axis may be written as a string)."""
    return {name: (axes,) if isinstance(axes, str) else tuple(axes)
            for name, axes in rules.items()}


def spec_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry splits its dimension over."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def logical_to_mesh(logical: Sequence[str | None], rules: Rules) -> P:
    """PartitionSpec over mesh axes for an array whose dimensions have these logical names.

    A mesh axis already used by an earlier dimension is dropped from later ones: an array can be
    split over an axis only once (e.g. activations [batch, length, embed] keep `fsdp` on batch).
    """
    used: set[str] = set()
    spec = []
    for name in logical:
        axes = tuple(a for a in rules.get(name, ()) if a not in used) if name else ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


def tree_shardings(logical_specs: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree whose leaves are PartitionSpecs of logical names."""
    return mesh_shardings(jax.tree.map(lambda spec: logical_to_mesh(spec, rules), logical_specs,
                                       is_leaf=lambda x: isinstance(x, P)), mesh)


def mesh_shardings(specs: Any, mesh: Mesh) -> Any:
    """NamedShardings for a pytree whose leaves are PartitionSpecs of `mesh`'s axes."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, P))


def split_further(spec: P, shape: Sequence[int], axes: Sequence[str],
                  mesh_shape: Mapping[str, int]) -> P | None:
    """`spec` also split over those of `axes` it does not use yet, on the first dimension they
    divide (with the axes it is split over already); None when no dimension is divisible."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for entry in entries for a in spec_axes(entry)}
    extra = tuple(a for a in axes if a not in used and mesh_shape[a] > 1)
    if not extra:
        return spec
    for dim, size in enumerate(shape):
        axes_here = spec_axes(entries[dim]) + extra
        if size % math.prod(mesh_shape[a] for a in axes_here) == 0:
            entries[dim] = axes_here
            return P(*entries)
    return None


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of [batch, length] input arrays."""
    return NamedSharding(mesh, logical_to_mesh(("batch", "length"), rules))


@contextlib.contextmanager
def use_rules(mesh: Mesh, rules: Rules):
    """Makes `constrain` shard activations over `mesh` by `rules` inside the block."""
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def with_rules(fn, mesh: Mesh, rules: Rules):
    """`fn`, run (and so traced under `jit`) with `mesh` and `rules` installed (`use_rules`)."""
    @functools.wraps(fn)
    def wrapped(*args):
        with use_rules(mesh, rules):
            return fn(*args)
    return wrapped


def active_mesh_and_rules() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) installed by `use_rules`, or None outside it."""
    return _ACTIVE.get()


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pins `x` to the sharding its logical axis names map to (no-op without active rules)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_mesh(logical, rules)))


def check_rules(rules: ml_collections.ConfigDict, mesh_shape: dict[str, int],
                sizes: dict[str, int]) -> None:
    """ConfigError unless `rules` (sharding.rules) names known logical and mesh axes, and every
    logical axis's length (`sizes`) divides over the mesh axes it is sharded over."""
    for name in rules.keys():
        if name not in LOGICAL_AXES:
            raise ConfigError(f"sharding.rules has unknown logical axis {name!r}; known axes: "
                              f"{LOGICAL_AXES}")
    for name in LOGICAL_AXES:
        axes = tuple(rules[name]) if name in rules else ()
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(f"sharding.rules.{name} names mesh axis {axis!r}; mesh axes "
                                  f"are {MESH_AXES}")
        shards = math.prod(mesh_shape[a] for a in axes)
        if sizes[name] % shards:
            where = "x".join(f"mesh.{a}={mesh_shape[a]}" for a in axes)
            raise ConfigError(
                f"logical axis {name!r} has size {sizes[name]}, not divisible by {where} "
                f"(= {shards}) it is sharded over; change the mesh or the size, or set "
                f"sharding.rules.{name} to shard it over fewer axes")
