"""JAX's CUDA plugin, and keeping it out of runs on hosts without NVIDIA GPUs.

The plugin holds XLA's GPU compiler: with it, any host compiles for GPU targets from a description
of the GPU (the `jaxscale[gpu-compile]` extra; jaxscale/plan/targets.py). On a host with no
NVIDIA driver, though, the plugin also starts with JAX's backends, loads its CUDA libraries, fails
to reach a driver and logs a traceback before JAX falls back to the CPU. `kept_out()` starts JAX
there with the CPU alone, as it would start without the plugin.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os

from jaxscale.runtime.tpu_host import is_tpu_vm

# The pip distributions of the plugin, whichever CUDA it was built for.
DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
INSTALL_HINT = ("pip install 'jaxscale[gpu-compile]' (JAX's CUDA plugin and the CUDA libraries "
                "it loads, about 5.5 GB)")
# What an NVIDIA driver puts on a host (a container with GPUs has the device nodes mounted).
DRIVER_PATHS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")


def installed() -> bool:
    """Whether JAX's CUDA plugin is installed."""
    for name in DISTRIBUTIONS:
        try:
            importlib.metadata.distribution(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def has_nvidia_driver(paths=DRIVER_PATHS) -> bool:
    return any(os.path.exists(path) for path in paths)


@contextlib.contextmanager
def kept_out():
    """Inside the block, JAX starts its backends without the CUDA plugin where the plugin is
    installed, JAX's platforms were not chosen (JAX_PLATFORMS), and the host has neither an
    NVIDIA driver nor TPU chips; enter it before the first device call. The choice is undone on
    leaving, for what runs in this process later."""
    import jax  # here, not above: the entry points import this module before parsing their flags

    chosen = jax.config.jax_platforms
    keep_out = installed() and not chosen and not has_nvidia_driver() and not is_tpu_vm()
    if keep_out:
        jax.config.update("jax_platforms", "cpu")
    try:
        yield
    finally:
        if keep_out:
            jax.config.update("jax_platforms", chosen)
