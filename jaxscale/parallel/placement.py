"""Where the train state's arrays live on a mesh, as PartitionSpecs over its axes: the parameters,
their optimizer moments, and the slices an offloaded update streams them in.

    params = param_specs(logical, shapes, like, rules, mesh_shape)     # every parameter
    moments = moment_specs(t_logical, t_shapes, t_params, rules, mesh_shape, layout)
    slices = streamed_slices(t_logical, t_shapes, t_params, moments, mesh_shape)

Each takes params-shaped trees: the parameters' logical PartitionSpecs (`logical`), their
ShapeDtypeStructs (`shapes`), and for `param_specs` the logical spec of the parameter whose
storage each one follows (`like`: its own, or a LoRA factor's weight's, jaxscale/models/lora.py
`followed_specs`). The moments and slices are the trained parameters' alone (`t_`: with LoRA
the adapters' entries of those trees). Nothing here knows a model: jaxscale/training/layout.py
`StateLayout` hands it the trees.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError
from jaxscale.parallel.sharding import Rules, logical_to_mesh, spec_axes, split_further


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def param_specs(logical: Any, shapes: Any, like: Any, rules: Rules,
                mesh_shape: Mapping[str, int]) -> Any:
    """Where each parameter lives in training: as its logical axes map by `rules`, and also split
    over the data-parallel axes (the `batch` rule's) that the parameter it follows (`like`) is
    split over and it is not, on its first dimension within a layer they divide; as it was when
    none does. A parameter that follows itself is split over none more.

    That extra split is for LoRA's factors (B of q [rank, heads, head_dim] lacks the `embed`
    that fsdp splits its weight on). Why only data-parallel axes: a split over one (FSDP) is
    storage, gathered before each use while the rows stay split; the factor is gathered like its
    weight (a small all-gather) and its float32 copy, gradient and moments shrink by the FSDP
    degree (benchmarks/lora.py, fsdp=4: 3x less adapter state, 0.5% more bytes all-gathered, the
    factors' gradients reduce-scattered instead of all-reduced, no all-to-all). `tensor` splits
    the computation: the activations are split over it on heads or mlp, which the factor either
    splits already or lacks (A of q [embed, rank]); spread over another dimension, its matmuls
    gather within the tensor group per layer and pass: far more bytes all-gathered for a sliver
    less state per chip (benchmarks/lora.py with fsdp=2 x tensor=2; benchmarks/RESULTS.md).
    `pipeline` is on `layers`, which the factor has already."""
    data_axes = rules.get("batch", ())

    def place(names: P, abstract, like_names: P) -> P:
        spec = logical_to_mesh(names, rules)
        followed = {a for entry in logical_to_mesh(like_names, rules) for a in spec_axes(entry)}
        axes = tuple(a for a in data_axes if a in followed)
        split = split_further(spec, _within_layer(names, abstract.shape), axes, mesh_shape)
        return spec if split is None else split

    return jax.tree.map(place, logical, shapes, like, is_leaf=_is_spec)


def _within_layer(logical: P, shape: tuple[int, ...]) -> tuple[int, ...]:
    """`shape` with its stacked `layers` dimension as 1, so that `split_further` never picks it.
    The scan's backward makes one layer's gradient at a time, which is reduce-scattered as it is
    made; split by layer, each layer's gradient would be all-reduced whole and kept by one
    device."""
    return tuple(1 if name == "layers" else size for name, size in zip(logical, shape))


def moment_specs(logical: Any, shapes: Any, params: Any, rules: Rules,
                 mesh_shape: Mapping[str, int], layout: str) -> Any:
    """Where each trained parameter's optimizer moments (and its gradient, before the update)
    live; the trees are the trained parameters', `params` their `param_specs`.

    `layout` `params`: with the parameter. `data` (ZeRO-1): also split over the data-parallel
    axes the parameter is not split over (those of the `batch` rule), so each data-parallel
    replica holds and updates 1/N of the state; the gradients are reduce-scattered onto that
    layout and the updated parameters gathered back to theirs. ConfigError when a parameter has
    no dimension (besides its stacked layers) those axes divide."""
    if layout == "params":
        return params
    data_axes = rules.get("batch", ())

    def further(path, names: P, param_spec: P, abstract) -> P:
        split = split_further(param_spec, _within_layer(names, abstract.shape), data_axes,
                              mesh_shape)
        if split is None:
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            degree = "x".join(f"{a}={mesh_shape[a]}" for a in data_axes if mesh_shape[a] > 1)
            aside = " besides its stacked layers" if "layers" in names else ""
            raise ConfigError(
                f"sharding.optimizer_state='data': parameter {name!r} {list(abstract.shape)} has "
                f"no dimension{aside} divisible by the data-parallel degree {degree}; use "
                "sharding.optimizer_state='params' or a data degree that divides its dimensions")
        return split

    return jax.tree_util.tree_map_with_path(further, logical, params, shapes, is_leaf=_is_spec)


def streamed_slices(logical: Any, shapes: Any, params: Any, moments: Any,
                    mesh_shape: Mapping[str, int]) -> Any:
    """For each trained parameter, in how many slices along its first dimension the update of
    offloaded moments streams it (jaxscale/training/optim.py `streamed_update`): a stack by
    layer; another parameter (the embedding, the head) in the fewest equal slices no larger
    than a layer of the largest stack, of a multiple of 8 rows (a TPU's tile: the compiler
    refuses some other slices of arrays in host memory, and one row of a stack of vectors in
    bfloat16, so a stack of norm scales goes whole); whole (1) where none is, or where a
    device holds only part of that dimension, of the parameter or of its moments (its entries
    of `params` and `moments`): a pipeline's layers, a split vocabulary. A slice of a split
    dimension would be gathered in the loop."""
    layer = max((a.size // a.shape[0] for names, a in
                 zip(jax.tree.leaves(logical, is_leaf=_is_spec), jax.tree.leaves(shapes))
                 if names[:1] == ("layers",)), default=0)

    def split(mesh_spec: P) -> bool:
        return bool(mesh_spec) and any(mesh_shape[a] > 1 for a in spec_axes(mesh_spec[0]))

    def count(names: P, param_spec: P, moment_spec: P, a) -> int:
        if not a.shape or split(param_spec) or split(moment_spec):
            return 1
        if names[:1] == ("layers",):
            return a.shape[0] if a.ndim > 2 else 1
        rows = a.shape[0]
        return next((k for k in range(1, rows // 8 + 1)
                     if rows % (8 * k) == 0 and a.size // k <= layer), 1)

    return jax.tree.map(count, logical, params, moments, shapes, is_leaf=_is_spec)
