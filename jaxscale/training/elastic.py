"""The same run on fewer devices: an elastic run restarted on the hosts it has keeps its global
batch, so that its learning-rate schedule, data order and losses are those of an uninterrupted run.

    config, devices, note = fitted(config, jax.devices(), full_devices)

`config` is written for `full_devices` (an elastic range's maximum). On fewer, the mesh's `-1` axis
is refilled for the devices present and `train.batch_size` stays the global batch: the rows each
device holds per microbatch must not grow (its memory was sized for the full count), so
`train.microbatches` (gradient accumulation, the same update: training/step.py) is raised as the
data-parallel width falls. When no width the devices give divides the batch, the fewest devices
are left idle that let one; `note` says what was chosen, for the start-up line. Configs with DCN
axes (several slices) are left as they are.
"""

from __future__ import annotations

import math

import ml_collections

from jaxscale.config import MESH_AXES
from jaxscale.errors import ConfigError
from jaxscale.parallel.mesh import resolve_mesh_shape


def batch_width(config: ml_collections.ConfigDict, num_devices: int) -> int | None:
    """How many ways the batch is split on `num_devices` devices (the product of the mesh axes the
    `batch` rule names), or None when the config's mesh does not fit that many."""
    try:
        ici, _ = resolve_mesh_shape(config.mesh, num_devices)
    except ConfigError:
        return None
    return math.prod(ici[axis] for axis in config.sharding.rules.batch)


def accumulation(batch: int, width: int, rows_per_device: int) -> int | None:
    """The fewest microbatches that split `batch` evenly over `width` devices with at most
    `rows_per_device` rows each (at least one); None when `width` does not divide `batch`."""
    if batch % width:
        return None
    fits = [k for k in range(1, batch // width + 1)
            if batch % k == 0 and (batch // k) % width == 0 and batch // k // width
            <= rows_per_device]
    return fits[0] if fits else batch // width  # one row per device: the least memory there is


def fitted(config: ml_collections.ConfigDict, devices: list, full_devices: int
           ) -> tuple[ml_collections.ConfigDict, list, str | None]:
    """(config, the devices to run on, what changed) for a run of `config`, written for
    `full_devices`, on `devices`. Raises ConfigError when no subset of them can hold the batch."""
    if len(devices) >= full_devices or math.prod(config.mesh.dcn.values()) != 1:
        return config, devices, None
    t = config.train
    full_width = batch_width(config, full_devices)
    if full_width is None:  # the config's own error, said by the checks that follow
        return config, devices, None
    rows = t.batch_size // t.microbatches // full_width
    for used in range(len(devices), 0, -1):
        width = batch_width(config, used)
        k = None if width is None else accumulation(t.batch_size, width, rows)
        if k is not None:
            break
    else:
        axes = {axis: config.mesh[axis] for axis in MESH_AXES}
        raise ConfigError(f"no mesh of the axes {axes} on at most {len(devices)} devices splits "
                          f"train.batch_size={t.batch_size}; set one axis to -1")
    fit = config.copy_and_resolve_references()
    fit.train.microbatches = k
    idle = len(devices) - used
    note = (f"elastic: {len(devices)} of {full_devices} devices, global batch {t.batch_size} kept: "
            f"data-parallel width {full_width} -> {width}, train.microbatches {t.microbatches} -> "
            f"{k}")
    if idle:
        note += (f"; {idle} device(s) left idle: no width of the {len(devices)} present "
                 f"divides {t.batch_size}")
    return fit, devices[:used], note
