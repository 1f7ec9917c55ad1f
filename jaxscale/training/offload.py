"""Optimizer-state host offload (`optim.offload_state`): Adam's moments live in the host's pinned
memory between steps, and move to the device for the update only.

Parameters, gradients and the two moments take 16 bytes per parameter on the devices in float32;
offloading the moments frees 8 of them, at the cost of copying them to the device and back every
step (over PCIe on GPUs), which overlaps with the forward and backward pass only as far as XLA's
scheduler manages. Their shardings are the
moments' usual ones with `memory_kind="pinned_host"`; the train step's outputs land there again
through its out_shardings.
"""

from __future__ import annotations

from typing import Any, Callable

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


def moments_to_device(train_step: Callable, opt_shardings: Any) -> Callable:
    """`train_step` whose state arrives with its optimizer state as `opt_shardings` place it (the
    moments in host memory): moved to the device, in the same layout, before the step computes
    with it."""
    # memory_kind None: the device's default memory (a sharding already there stays as it is).
    on_device = jax.tree.map(lambda sharding: sharding.with_memory_kind(None), opt_shardings)

    def step(state, batch):
        opt_state = jax.device_put(state.opt_state, on_device)
        return train_step(state._replace(opt_state=opt_state), batch)
    return step
