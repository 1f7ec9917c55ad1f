"""The same run on fewer devices: an elastic run restarted on the hosts it has keeps its global
batch, so that its learning-rate schedule, data order and losses are those of an uninterrupted run.

    config, devices, note = fitted(config, jax.devices(), full_devices)

`config` is written for `full_devices` (an elastic range's maximum). On fewer, the mesh's `-1` axis
is refilled for the devices present and `train.batch_size` stays the global batch: the rows each
device holds per microbatch must not grow (its memory was sized for the full count), so
`train.microbatches` (gradient accumulation, the same update: training/step.py) is raised as the
data-parallel width falls. When no width the devices give divides the batch, the fewest devices
are left idle that let one; `note` says what was chosen, for the start-up line.

On a count whose refit would leave a whole host's devices idle, the run cannot start (a process
holding no shard still takes part in every step): such a count starts on the largest count below
it that runs, and the other hosts wait as spares (checks.runs_on, used by runtime/rendezvous.py).

A config with a DCN factor across hosts (GPU nodes: `mesh.dcn.data=8` for 8 of them) keeps each
host's ICI layout, and the one DCN factor the batch is split over is set to the hosts present
(8 -> 6): hosts are never left idle, since a process holding no device of the mesh would still
have to take part in every collective. TPU slices are left as they are: a slice cannot run
without one of its hosts, so a run of several loses a whole slice or nothing.
"""

from __future__ import annotations

import math

import ml_collections

from jaxscale.config import MESH_AXES
from jaxscale.errors import ConfigError
from jaxscale.parallel.mesh import asks_for_dcn, granules_are_slices, resolve_mesh_shape


def batch_width(config: ml_collections.ConfigDict, num_devices: int, num_hosts: int = 1
                ) -> int | None:
    """How many ways the batch is split on `num_devices` devices over `num_hosts` DCN granules
    (the product of the mesh axes the `batch` rule names, ICI and DCN factors together), or None
    when the config's mesh does not fit that many."""
    try:
        ici, dcn = resolve_mesh_shape(config.mesh, num_devices, num_hosts)
    except ConfigError:
        return None
    return math.prod(ici[axis] * dcn[axis] for axis in config.sharding.rules.batch)


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
    if len(devices) >= full_devices:
        return config, devices, None
    if asks_for_dcn(config.mesh):
        if granules_are_slices(devices):  # TPU slices: a whole one or nothing (the docstring)
            return config, devices, None
        return _fitted_over_hosts(config, devices, full_devices)
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


def _fitted_over_hosts(config: ml_collections.ConfigDict, devices: list, full_devices: int
                       ) -> tuple[ml_collections.ConfigDict, list, str | None]:
    """`fitted` for a config with DCN factors across hosts: the batch's DCN factor set to the
    hosts present, every device of each used."""
    t, dcn = config.train, config.mesh.dcn
    full_hosts = math.prod(dcn.values())
    hosts = len({d.process_index for d in devices})
    split = [axis for axis in config.sharding.rules.batch if dcn[axis] != 1]
    others = full_hosts // dcn[split[0]] if len(split) == 1 else 0
    if not others or hosts % others:
        raise ConfigError(
            f"mesh.dcn {dict(dcn)} cannot be refitted to the {hosts} hosts present: the batch "
            f"must be split over exactly one DCN factor ({split or 'none is'}), and the others "
            f"({others or '-'} hosts) must divide {hosts}; set one batch axis of mesh.dcn to the "
            "host count and the others to 1")
    fit = config.copy_and_resolve_references()
    fit.mesh.dcn[split[0]] = hosts // others
    full_width = batch_width(config, full_devices, full_hosts)
    if full_width is None:  # the config's own error, said by the checks that follow
        return config, devices, None
    width = batch_width(fit, len(devices), hosts)
    k = None if width is None else accumulation(t.batch_size, width,
                                                 t.batch_size // t.microbatches // full_width)
    if k is None:
        raise ConfigError(
            f"train.batch_size={t.batch_size} does not split over the data-parallel width "
            f"{width} of {hosts} hosts; choose a batch size every host count of the range divides")
    fit.train.microbatches = k
    return fit, devices, (
        f"elastic: {hosts} of {full_hosts} hosts, global batch {t.batch_size} kept: mesh.dcn."
        f"{split[0]} {dcn[split[0]]} -> {hosts // others}, data-parallel width {full_width} -> "
        f"{width}, train.microbatches {t.microbatches} -> {k}")


