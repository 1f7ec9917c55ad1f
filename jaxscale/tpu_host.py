"""libtpu on a host without a TPU.

The `jaxscale[tpu]` extra (and the test extra) installs libtpu on any host, to compile for TPU
slices. On a host with no TPU, libtpu then prints a page of warnings when JAX starts its backends
(it cannot find this host's TPU type or its workers' addresses) before JAX falls back to the CPU.
Telling it what to assume keeps it quiet; nothing runs on, or is compiled for, these values:
compile targets come from a topology description (jaxscale/plan/targets.py).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os

ASSUMED = {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost"}


def is_tpu_vm() -> bool:
    """TPU VMs expose their chips as /dev/accel* (v4, v5e, v6e) or through VFIO (v5p)."""
    return bool(glob.glob("/dev/accel*")) or os.path.exists("/dev/vfio")


@contextlib.contextmanager
def quiet_libtpu():
    """Inside the block, libtpu starts quietly on a host without a TPU; JAX starts its backends
    once, so enter it before the first device call. The variables are removed again on leaving:
    a child process started later (a `jaxscale.train` from the launchers) must not take them for
    a TPU pod's. Changes nothing on a TPU VM, without libtpu, or for variables the user set."""
    added = []
    if not is_tpu_vm() and importlib.util.find_spec("libtpu") is not None:
        added = [name for name in ASSUMED if name not in os.environ]
        os.environ.update({name: ASSUMED[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
