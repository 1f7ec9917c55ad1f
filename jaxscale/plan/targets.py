"""Targets to plan for: the local devices, simulated CPUs, a TPU slice compiled by the TPU
compiler (`libtpu`, the `jaxscale[tpu]` extra) on any host, TPU or not, or GPU nodes compiled by
XLA's GPU compiler (the CUDA plugin, the `jaxscale[gpu-compile]` extra) on any host, GPU or not.

TPU targets are written `<generation>-<chips>` (`v5p-64`, `v5e-16`) or as a topology
(`v5p:4x4x4`). The number counts chips: Google's own names for v4 and v5p slices count TensorCores,
two per chip, so our `v5p-64` is Cloud TPU's `v5p-128`. `SLICESx<slice>` (`2xv5p-64`) is a
multi-slice job: that many slices joined by DCN, compiled for as one (the TPU compiler describes
multi-slice topologies too), so the search splits the slices over the DCN axes.

GPU targets are `h100:N`, `h200:N`, `a100:N` (N GPUs, 8 per node) or `h100:NODESxGPUS`. XLA
compiles for a GPU from a description of it, no GPU attached: `gpu_specs/` holds each model's
(XLA's `GpuTargetConfigProto`: memory, bandwidth, cores, compute capability), and the CUDA
plugin's topology of NODES processes of GPUS devices each is what the candidates compile for, so
their memory is the compiler's. Without the plugin they are planned from the analytic models
alone, and the planner says so.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import jax

from jaxscale.errors import ConfigError
from jaxscale.plan.compiled import refused_by_xla
from jaxscale.runtime import cuda_plugin
from jaxscale.runtime.chips import CHIPS, GPU_CHIPS, Chip, chip_for_device_kind
from jaxscale.runtime.tpu_host import quiet_libtpu

# Chips per slice -> the slice's shape, for the shapes Cloud TPU offers. v4 and v5p slices are 3-D
# tori; v5e and v6e slices are 2-D.
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8",
              256: "4x8x8", 512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16",
              256: "16x16"}
TPU_GENERATIONS = {"v4": _SHAPES_3D, "v5p": _SHAPES_3D, "v5e": _SHAPES_2D, "v6e": _SHAPES_2D}
_TPU_CHIPS = {"v4": "TPU v4", "v5p": "TPU v5p", "v5e": "TPU v5e", "v6e": "TPU v6e"}
# Each GPU's description for XLA's compiler (files in gpu_specs/).
_GPU_SPECS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb", "a100": "a100_sxm_80.txtpb"}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user wrote it
    platform: str  # "tpu", "cpu", "gpu" or "local"
    topology: str | None  # "v5p:4x4x4" for TPU targets, "1x2x8" (1 x nodes x GPUs) for GPUs
    num_devices: int
    chip_name: str | None = None  # a key of chips.CHIPS; None: CPUs (no table entry)
    # DCN-connected groups the devices form: GPU nodes or TPU slices; 1 for one slice or host.
    granules: int = 1
    gpu: str = ""  # GPU targets: the key of _GPU_SPECS ("h100"), else ""

    @property
    def chip(self) -> Chip | None:
        return CHIPS[self.chip_name] if self.chip_name else None

    @property
    def device_platform(self) -> str:
        """Its devices' `jax.Device.platform`: "tpu", "gpu" or "cpu" (local: this process's)."""
        return jax.devices()[0].platform if self.platform == "local" else self.platform

    @property
    def compiles(self) -> bool:
        """Whether candidates can be compiled for it here (GPUs: with the CUDA plugin)."""
        return self.platform != "gpu" or cuda_plugin.installed()


def local_target(devices) -> Target:
    """These devices, whatever they are: this process can compile for them (GPUs included)."""
    chip = chip_for_device_kind(devices[0].device_kind)
    return Target("local", "local", None, len(devices), chip.name if chip else None)


def parse_target(spec: str) -> Target:
    """`local`, `cpu:N`, `v5p-64` or `v5p:4x4x4` -> Target; ConfigError on anything else."""
    if spec == "local":
        return local_target(jax.devices())
    if m := re.fullmatch(r"cpu:(\d+)", spec):
        return Target(spec, "cpu", None, int(m.group(1)))
    if m := re.fullmatch(r"(?:(\d+)x)?(v4|v5p|v5e|v6e)-(\d+)", spec):
        slices, generation, chips = int(m.group(1) or 1), m.group(2), int(m.group(3))
        shapes = TPU_GENERATIONS[generation]
        if chips not in shapes or slices < 1:
            raise ConfigError(f"target {spec!r} is not a {generation} slice size; use one of "
                              + ", ".join(f"{generation}-{n}" for n in shapes)
                              + f" (or SLICESx{generation}-N for several slices)")
        return Target(spec, "tpu", f"{generation}:{shapes[chips]}", chips * slices,
                      _TPU_CHIPS[generation], granules=slices)
    if m := re.fullmatch(r"(v4|v5p|v5e|v6e):(\d+(?:x\d+){1,2})", spec):
        chips = math.prod(int(d) for d in m.group(2).split("x"))
        return Target(spec, "tpu", spec, chips, _TPU_CHIPS[m.group(1)])
    if m := re.fullmatch(r"(h100|h200|a100):(?:(\d+)x)?(\d+)", spec):
        return _gpu_target(spec, m.group(1), m.group(2), int(m.group(3)))
    raise ConfigError(f"target {spec!r} is unknown; use local, cpu:N, a TPU slice such as "
                      "v5p-64 or v5e-16 (chips), slices such as 2xv5p-64, a topology such as "
                      "v5p:4x4x4, or GPUs such as "
                      "h100:16 or h100:2x8 (nodes x GPUs per node)")


def _gpu_target(spec: str, kind: str, nodes: str | None, count: int) -> Target:
    """`h100:16` (GPUs, 8 per node) or `h100:2x8` (nodes x GPUs per node)."""
    chip = CHIPS[GPU_CHIPS[kind]]
    if nodes is None:
        per_node = min(count, chip.per_granule)
        if count < 1 or count % per_node:
            raise ConfigError(f"target {spec!r}: {count} GPUs do not fill whole nodes of "
                              f"{chip.per_granule}; use a multiple of {chip.per_granule}, or "
                              f"{kind}:NODESxGPUS")
        nodes_count = count // per_node
    else:
        nodes_count, per_node = int(nodes), count
        if not (nodes_count >= 1 and 1 <= per_node <= chip.per_granule):
            raise ConfigError(f"target {spec!r}: a node has 1 to {chip.per_granule} GPUs and "
                              "there is at least one node")
    return Target(spec, "gpu", f"1x{nodes_count}x{per_node}", nodes_count * per_node,
                  chip.name, granules=nodes_count, gpu=kind)


def target_devices(target: Target) -> list:
    """The devices to build the mesh over. TPU devices come from the TPU compiler's description
    of the topology: they can be compiled for, not run on."""
    if target.platform == "local":
        return jax.devices()
    if target.platform == "gpu":
        return _gpu_devices(target)
    if target.platform == "cpu":
        devices = jax.devices("cpu")
        if len(devices) < target.num_devices:
            raise ConfigError(
                f"target {target.name!r} needs {target.num_devices} CPU devices, JAX has "
                f"{len(devices)}; set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{target.num_devices} before starting")
        return devices[:target.num_devices]
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(f"target {target.name!r} needs the TPU compiler; install it with "
                          "pip install 'jaxscale[tpu]'")
    # libtpu takes a host-wide lock meant for processes that run on the TPU; compiling needs no
    # TPU, so several processes (tests, a planner beside a benchmark) may compile at once.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    try:
        with quiet_libtpu():
            return list(topologies.get_topology_desc(target.topology, "tpu",
                                                     num_slices=target.granules).devices)
    except jax.errors.JaxRuntimeError as e:  # e.g. a topology this libtpu does not know
        if not refused_by_xla(e):
            raise
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"the TPU compiler cannot describe target {target.name!r} "
                          f"({first_line}); pick another slice size") from None


def _gpu_devices(target: Target) -> list:
    """The devices of `target`'s GPU nodes, as the CUDA plugin describes them from the GPU's spec
    (one process per node). The process must not run on a GPU backend: JAX_PLATFORMS=cpu, as
    `python -m jaxscale.plan` sets for targets other than local."""
    if not cuda_plugin.installed():
        raise ConfigError(f"target {target.name!r} needs XLA's GPU compiler: "
                          f"{cuda_plugin.INSTALL_HINT}")
    from jax.experimental import topologies
    spec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs",
                        _GPU_SPECS[target.gpu])
    with open(spec, encoding="utf-8") as f:
        description = f.read()
    try:
        topology = topologies.get_topology_desc(target.gpu, "cuda", target_config=description,
                                                topology=target.topology)
    except NotImplementedError:  # JAX has no CUDA platform registered
        raise ConfigError(
            f"target {target.name!r}: JAX's CUDA plugin did not start in this process; on a "
            "host without an NVIDIA driver it starts for compiling only when JAX's platforms "
            "are chosen before JAX starts: set JAX_PLATFORMS=cpu (python -m jaxscale.plan "
            "does)") from None
    return list(topology.devices)
