"""Device memory for the metrics, as the backend's allocator reports it (`Device.memory_stats()`).

GPUs and TPUs report bytes in use, the peak since the process started, and the limit; CPUs report
nothing (None), and then nothing is logged. Of this process's devices the fullest one is logged:
it is the one that runs out first.
"""

from __future__ import annotations

from jaxscale.plan.compiled import GIB

# metric name -> memory_stats() key
_STATS = {"memory_in_use_gib": "bytes_in_use", "memory_peak_gib": "peak_bytes_in_use",
          "memory_limit_gib": "bytes_limit"}


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
