"""Device memory, as the backend's allocator reports it (`Device.memory_stats()`): for the metrics,
and the capacity the train step's compiled memory is checked against before a run starts.

GPUs and TPUs report bytes in use, the peak since the process started, and the limit; CPUs report
nothing (None), and then nothing is logged. Of this process's devices the fullest one is logged:
it is the one that runs out first.
"""

from __future__ import annotations

from jaxscale.errors import ConfigError
from jaxscale.plan.compiled import GIB, StepMemory

# metric name -> memory_stats() key
_STATS = {"memory_in_use_gib": "bytes_in_use", "memory_peak_gib": "peak_bytes_in_use",
          "memory_limit_gib": "bytes_limit"}
REMEDIES = ("shard the state further (a larger mesh.fsdp), set model.remat=full, raise "
            "train.microbatches, set optim.moment_dtype=bfloat16, or let the planner choose a "
            "layout that fits (python -m jaxscale.plan, or --config.mesh.auto=True)")


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
