"""Optimizer-state host offload (`optim.offload_state`): Adam's moments live in the host's pinned
memory between steps and stream through the device during the update, a layer or a parameter at
a time.

Parameters, gradients and the two moments take 16 bytes per parameter on the devices in float32;
offloading the moments frees 8 of them, at the cost of copying them to the device and back every
step (over PCIe on GPUs). Their shardings are the moments' usual ones with
`memory_kind="pinned_host"`, and the train step's outputs land there again through its
out_shardings. The optimizer's update (`jaxscale.training.optim.streamed_update`) holds one
layer's moments of the stacked layers' weights at a time, and two of the other parameters',
instead of all of them, so that the step's peak is the backward pass (the compute-dtype copies of
the weights and the stacked gradients), not the update: benchmarks/offload.py compiles both for a
TPU v5p chip, and benchmarks/RESULTS.md has its figures.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxscale.errors import ConfigError

HOST_MEMORY = "pinned_host"


def check_supported(devices) -> None:
    """ConfigError unless this process's devices have a pinned host memory to offload into."""
    local = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
    kinds = {memory.kind for memory in local[0].addressable_memories()}
    if HOST_MEMORY not in kinds:
        raise ConfigError(
            f"optim.offload_state=True: {local[0].platform} devices ({local[0].device_kind}) have "
            f"no {HOST_MEMORY!r} memory in jax {jax.__version__} (their memories: "
            f"{sorted(kinds)}); set optim.offload_state=False, or halve the moments with "
            "optim.moment_dtype='bfloat16'")


def on_host(shardings: Any) -> Any:
    """The same shardings, in pinned host memory."""
    return jax.tree.map(lambda sharding: sharding.with_memory_kind(HOST_MEMORY), shardings)
