"""Device mesh: the axes of jaxscale/config.py MESH_AXES (data, pipeline, fsdp, context, expert,
tensor); each an ICI size times a DCN factor."""

from __future__ import annotations

import math

import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

# Outermost (devices far apart, slow links) to innermost (neighbours on the fastest links): the
# device mesh is laid out in MESH_AXES' order, so tensor parallelism gets the closest devices.
from jaxscale.config import MESH_AXES
from jaxscale.errors import ConfigError


class MeshLayoutError(ConfigError):
    """The devices' network cannot hold the mesh: a TPU torus lays each mesh axis over whole
    physical axes, and some axis size is no product of them. The planner records it as that
    candidate's refusal; a run stops with it (exit 2)."""


def granules_are_slices(devices) -> bool:
    """TPU devices are grouped by slice (ICI inside, DCN between); everything else by host. GPU
    and CPU devices of a multi-process run carry a `slice_index` too, but it is 0 on every host:
    it says nothing about the network between them."""
    return devices[0].platform == "tpu" and hasattr(devices[0], "slice_index")


def granule_of(device, slices: bool) -> int:
    return device.slice_index if slices else device.process_index


def asks_for_dcn(mesh_config: ml_collections.ConfigDict) -> bool:
    """Whether any `mesh.dcn` factor is above 1 (a missing key is `validate`'s to report)."""
    return any(int(mesh_config.dcn.get(a, 1)) != 1 for a in MESH_AXES)


def dcn_granules(mesh_config: ml_collections.ConfigDict, devices) -> int:
    """How many DCN-connected granules the mesh spans: 1 unless a `mesh.dcn` factor asks for more,
    then the number of TPU slices, or of hosts (processes) elsewhere. The launchers' pre-checks
    count the same way (`--granules`: slices on TPU, hosts or nodes on GPU)."""
    if not asks_for_dcn(mesh_config):
        return 1
    slices = granules_are_slices(devices)
    return len({granule_of(d, slices) for d in devices})


def build_mesh(ici: dict[str, int], dcn: dict[str, int], devices) -> Mesh:
    """The Mesh of (ici, dcn) axis sizes (from `jaxscale.checks.validate`) over `devices`.

    With every DCN factor 1 the whole mesh is laid out as if ICI-connected; otherwise
    `create_hybrid_device_mesh` keeps the fast axes inside a slice (or host) and the DCN factors
    across them.
    """
    devices = list(devices)
    ici_shape = [ici.get(a, 1) for a in MESH_AXES]  # an axis not named has size 1
    dcn_shape = [dcn.get(a, 1) for a in MESH_AXES]
    try:
        if any(n > 1 for n in dcn_shape):
            device_array = mesh_utils.create_hybrid_device_mesh(
                ici_shape, dcn_shape, devices,
                process_is_granule=not granules_are_slices(devices))
        elif devices[0].platform == "cpu":
            # CPU devices have no physical topology; keep their order so that process-local
            # devices stay contiguous along the leading axes.
            device_array = np.array(devices).reshape(ici_shape)
        else:
            device_array = mesh_utils.create_device_mesh(ici_shape, devices)
    except NotImplementedError:  # how mesh_utils says a torus cannot hold the shape unsplit
        sizes = {a: n for a, n in ici.items() if n > 1}
        torus = torus_shape(devices)
        raise MeshLayoutError(
            f"mesh {sizes} cannot be laid out on the {'x'.join(map(str, torus)) or 'physical'} "
            f"torus of these {devices[0].device_kind} chips: each mesh axis spans whole torus "
            f"axes, its size a product of some of {list(torus) or 'their sizes'}; choose such "
            "sizes, or --config.mesh.auto=True") from None
    return Mesh(device_array, MESH_AXES)


def torus_shape(devices) -> tuple[int, ...]:
    """The physical (x, y, z) extent of TPU chips in one slice, from their coordinates; () for
    devices without any."""
    coords = [d.coords for d in devices if getattr(d, "coords", None) is not None
              and getattr(d, "slice_index", 0) == getattr(devices[0], "slice_index", 0)]
    if not coords:
        return ()
    return tuple(max(c[i] for c in coords) - min(c[i] for c in coords) + 1
                 for i in range(len(coords[0])))


def resolve_mesh_shape(mesh: ml_collections.ConfigDict, num_devices: int,
                       num_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """Returns (ici, dcn) axis sizes with every -1 filled in.

    `num_slices` is how many DCN-connected granules (slices or hosts) the devices form; their
    product of `mesh.dcn.*` must equal it, and the ICI sizes must fill one granule.
    """
    dcn = {a: int(mesh.dcn[a]) for a in MESH_AXES}
    if math.prod(dcn.values()) != num_slices:
        raise ConfigError(
            f"mesh.dcn sizes {dcn} multiply to {math.prod(dcn.values())} but there are "
            f"{num_slices} slices/hosts; make their product {num_slices}")
    per_slice = num_devices // num_slices
    ici = {a: int(mesh[a]) for a in MESH_AXES}
    free = [a for a, v in ici.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh axes {free} are all -1; at most one axis may take the rest")
    fixed = math.prod(v for v in ici.values() if v != -1)
    if free:
        if per_slice % fixed:
            raise ConfigError(
                f"mesh sizes {ici} leave no whole size for mesh.{free[0]}: {per_slice} devices "
                f"per slice are not divisible by {fixed}; change the fixed mesh sizes")
        ici[free[0]] = per_slice // fixed
    if math.prod(ici.values()) != per_slice:
        raise ConfigError(
            f"mesh sizes {ici} multiply to {math.prod(ici.values())} but there are {per_slice} "
            f"devices{' per slice' if num_slices > 1 else ''}; make the product {per_slice} or "
            "set one axis to -1")
    return ici, dcn
