"""Whether this host has TPU chips, and libtpu on a host without them.

`is_tpu_vm` reads the PCI bus (`tpu_chips`): a Cloud TPU VM runs a multi-host run without any
scheduler variables, so runtime.distributed must know, before JAX starts, that chips are there.

The `jaxscale[tpu]` extra (and the test extra) installs libtpu on any host, to compile for TPU
slices. On a host with no TPU, libtpu then prints a page of warnings when JAX starts its backends
(it cannot find this host's TPU type or its workers' addresses) before JAX falls back to the CPU.
Telling it what to assume keeps it quiet; nothing runs on, or is compiled for, these values:
compile targets come from a topology description (jaxscale/plan/targets.py).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

from jaxscale.errors import JaxscaleError

ASSUMED = {"TPU_ACCELERATOR_TYPE": "v5p-8", "TPU_WORKER_HOSTNAMES": "localhost"}

PCI_DEVICES = "/sys/bus/pci/devices"
GOOGLE_PCI_VENDOR_ID = "0x1ae0"
# The PCI device ids of TPU chips (v3, an unnamed one, v4, v5p, v5e, v6e, TPU7x, TPU8i, TPU8t):
# JAX's own list (jax/_src/hardware_utils.py, private, so copied here; tests/test_distributed.py
# fails when JAX's list has an id this one lacks). The vendor alone is not enough: Google's gVNIC
# network card and other virtual devices of every Compute Engine VM carry it too.
TPU_PCI_DEVICE_IDS = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
                                "0x0076", "0x0083", "0x007c"})


def tpu_chips(pci_devices: str = PCI_DEVICES) -> int:
    """How many TPU chips sit on this host's PCI bus, read the way JAX reads them (each device's
    `vendor` and `device` files in sysfs); 0 on a host without a PCI bus in sysfs (macOS). A file
    that cannot be read raises: a wrong "no TPU" would make a TPU VM train alone."""
    if not os.path.isdir(pci_devices):
        return 0
    chips = 0
    for device in sorted(os.listdir(pci_devices)):
        path = os.path.join(pci_devices, device)
        if _read_id(os.path.join(path, "vendor")) == GOOGLE_PCI_VENDOR_ID:
            chips += _read_id(os.path.join(path, "device")) in TPU_PCI_DEVICE_IDS
    return chips


def _read_id(path: str) -> str:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError as e:
        raise JaxscaleError(
            f"cannot read {path} ({e.strerror or e}) to tell whether TPU chips are attached; run "
            "where /sys/bus/pci can be read (in a container: mount the host's /sys read-only)"
        ) from None


def is_tpu_vm() -> bool:
    """Whether TPU chips are attached to this host."""
    return tpu_chips() > 0


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
