"""Device memory: what the compiled train step needs per device (`StepMemory`, from XLA's buffer
assignment), and what a device holds, as the backend's allocator reports it
(`Device.memory_stats()`): for the metrics, and the check before a run starts that the step fits.

GPUs and TPUs report bytes in use, the peak since the process started, and the limit; CPUs report
nothing (None), and then nothing is logged. Of this process's devices the fullest one is logged:
it is the one that runs out first.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxscale.errors import ConfigError
from jaxscale.runtime.chips import GIB

# metric name -> memory_stats() key
_STATS = {"memory_in_use_gib": "bytes_in_use", "memory_peak_gib": "peak_bytes_in_use",
          "memory_limit_gib": "bytes_limit"}
REMEDIES = ("shard the state further (a larger mesh.fsdp), set model.remat=full, raise "
            "train.microbatches, set optim.moment_dtype=bfloat16, or let the planner choose a "
            "layout that fits (python -m jaxscale.plan, or --config.mesh.auto=True)")


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device of the compiled train step, from XLA's buffer assignment
    (`memory_analysis()`), in the device's memory: XLA reports buffers placed in host memory
    (offloaded optimizer state on GPUs and TPUs) apart, in its `host_*` figures."""
    arguments: int  # the train state and the batch
    outputs: int  # the new state (donated: it reuses the arguments' buffers)
    aliased: int  # outputs that reuse argument buffers
    temporaries: int  # everything the step allocates while it runs
    code: int
    # The compiler's own peak of the buffers live at once, arguments included: the TPU compiler's
    # is its heap's; a CPU's is only the arguments (0: not reported).
    peak: int = 0

    @property
    def total(self) -> int:
        """Bytes the step needs on a device: its inputs, its outputs that do not reuse an input's
        buffer, and its working memory (MaxText's `train_compile` sums the same; code excluded).
        On a TPU this overstates: its temporaries count more than the step's heap in HBM, by
        about the donated arguments' size (`peak` is the heap; benchmarks/RESULTS.md compares
        them for llama3_8b on v5p-64)."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def line(self) -> str:
        """The breakdown, in GiB per device (3 significant digits: CPU test models are small)."""
        return (f"arguments {self.arguments / GIB:.3g} GiB, outputs {self.outputs / GIB:.3g} GiB "
                f"({self.aliased / GIB:.3g} of them in the donated arguments' buffers), "
                f"temporaries {self.temporaries / GIB:.3g} GiB, total {self.total / GIB:.3g} GiB")


def step_memory(compiled: jax.stages.Compiled) -> StepMemory:
    m = compiled.memory_analysis()
    return StepMemory(arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                      aliased=m.alias_size_in_bytes, temporaries=m.temp_size_in_bytes,
                      code=m.generated_code_size_in_bytes,
                      peak=m.peak_memory_in_bytes)


def memory_metrics(devices) -> dict[str, float]:
    """{memory_in_use_gib, memory_peak_gib, memory_limit_gib}: the largest over `devices` of each
    figure their backend reports (GiB per device); {} when it reports none."""
    stats = [device.memory_stats() or {} for device in devices]
    metrics = {}
    for name, key in _STATS.items():
        values = [s[key] for s in stats if key in s]
        if values:
            metrics[name] = max(values) / GIB
    return metrics


def device_capacity(devices, gib: float) -> tuple[int, str] | None:
    """(bytes one device may hold, where that figure comes from): `gib` GiB when it is not 0
    (performance.device_memory_gib), else the smallest allocator limit (`bytes_limit`) that the
    backend reports for `devices` (this process's); None when neither is known (CPUs)."""
    if gib:
        return int(gib * GIB), f"performance.device_memory_gib={gib:g}"
    limits = [s["bytes_limit"] for s in (d.memory_stats() or {} for d in devices)
              if "bytes_limit" in s]
    if not limits:
        return None
    # On GPUs the limit is XLA_PYTHON_CLIENT_MEM_FRACTION of the memory (75% by default).
    return min(limits), "the allocator's limit"


def memory_line(memory: StepMemory, capacity: tuple[int, str] | None) -> str:
    """What the train step needs per device, next to what a device holds."""
    line = f"train step memory per device: {memory.line()}"
    if capacity is None:
        return (f"{line}; the device's capacity is unknown (its backend reports none; set "
                "performance.device_memory_gib=G to check against G GiB)")
    limit, source = capacity
    return (f"{line} of capacity {limit / GIB:.3g} GiB ({100 * memory.total / limit:.0f}%, "
            f"{source})")


def check_fits(memory: StepMemory, capacity: tuple[int, str] | None) -> None:
    """ConfigError naming the shortfall and the remedies when the step needs more than a device
    holds; nothing when the capacity is unknown."""
    if capacity is None or memory.total <= capacity[0]:
        return
    limit, source = capacity
    raise ConfigError(
        f"the train step does not fit: per device it needs {memory.line()}, but a device holds "
        f"{limit / GIB:.3g} GiB ({source}): {(memory.total - limit) / GIB:.3g} GiB short; to "
        f"fit, {REMEDIES}")
