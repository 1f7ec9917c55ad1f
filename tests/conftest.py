"""Every test sees 8 simulated CPU devices, so any 8-device mesh can be built.

The CPU compiler's backend optimizations are off (LLVM at -O0): the suite's time is mostly spent
compiling small programs, 30% less this way on 2 cores. The programs are the same; their machine
code is slower and may sum floats in another order, which moves a value in its last bits, within
the tolerances the tests hold sharded runs to. The CLI runs that tests start inherit the flags."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# After the flags, which must be set before JAX is imported (by any test module, after this).
import pytest


@pytest.fixture
def no_gpu_compiler(monkeypatch):
    """As on a host without JAX's CUDA plugin: GPU targets are planned from the estimates alone
    (compiling a large model for GPUs takes minutes)."""
    from jaxscale.runtime import cuda_plugin

    monkeypatch.setattr(cuda_plugin, "installed", lambda: False)
