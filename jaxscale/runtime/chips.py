"""The accelerators jaxscale knows: memory, peak speed, memory and link bandwidths per chip, in one
table.

The metrics (MFU) and the planner (what fits, how fast) both read it. Figures are the vendors'
datasheet values; where a page gives a range or none, the comment says what was assumed.
"""

from __future__ import annotations

import dataclasses
import re

GIB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int  # memory per chip
    peak_bf16_flops: float  # dense (no sparsity) bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s between the chip and its memory (HBM)
    # Bidirectional bandwidth of the fast links per chip (TPU ICI, all ports; NVLink), bytes/s.
    fast_link_bidir: float
    # The slow network per chip (TPU DCN, GPU node NICs), bytes/s in one direction.
    network: float
    fast_link: str  # "ICI" or "NVLink": what the report calls the fast links
    per_granule: int  # chips per host (TPU) or per node (GPU, the NVLink domain)
    compute_capability: str = ""  # NVIDIA GPUs' (what cuDNN's kernels need); "" for TPUs

    @property
    def fast_link_bandwidth(self) -> float:
        """Bytes/s a chip sends during a ring collective: half the bidirectional figure (it
        receives as much at the same time)."""
        return self.fast_link_bidir / 2


GB = 1e9
CHIPS = {c.name: c for c in (
    # cloud.google.com/tpu/docs/v4: 32 GiB HBM2 at 1200 GBps, 275 TFLOP/s; ICI 2400 Gbps = 300 GB/s
    # per chip. DCN per chip is not published for v4; assumed as v5p's 50 Gbps.
    Chip("TPU v4", 32 * GIB, 275e12, 1200 * GB, 300 * GB, 50e9 / 8, "ICI", 4),
    # cloud.google.com/tpu/docs/v5e: 16 GB HBM2 at 819 GBps, 197 TFLOP/s, ICI 400 GB/s
    # bidirectional per chip; 2 x 100 Gbps NICs per 8-chip host = 25 Gbps per chip.
    Chip("TPU v5e", 16 * GIB, 197e12, 819 * GB, 400 * GB, 25e9 / 8, "ICI", 8),
    # cloud.google.com/tpu/docs/v5p: 95 GiB HBM2e at 2765 GBps, 459 TFLOP/s, ICI 1200 GB/s
    # bidirectional per chip, DCN 50 Gbps per chip.
    Chip("TPU v5p", 95 * GIB, 459e12, 2765 * GB, 1200 * GB, 50e9 / 8, "ICI", 4),
    # cloud.google.com/tpu/docs/v6e: 32 GB HBM at 1640 GBps (1638 in one revision of the page),
    # 918 TFLOP/s, ICI 800 GB/s bidirectional per chip; DCN assumed 4 x 200 Gbps NICs per 8-chip
    # host = 100 Gbps per chip.
    Chip("TPU v6e", 32 * GIB, 918e12, 1640 * GB, 800 * GB, 100e9 / 8, "ICI", 8),
    # NVIDIA H100 datasheet (SXM5): 80 GB HBM3 at 3.35 TB/s, 989 TFLOP/s dense bf16, NVLink
    # 900 GB/s; network one 400 Gbps ConnectX-7 NIC per GPU (DGX H100, GCP A3 Ultra).
    Chip("H100 SXM", 80 * GIB, 989e12, 3350 * GB, 900 * GB, 400e9 / 8, "NVLink", 8, "9.0"),
    # H100 PCIe: 80 GB HBM2e at 2 TB/s, 756 TFLOP/s; NVLink bridge 600 GB/s between pairs, PCIe
    # otherwise; the planner has no target for it (metrics only).
    Chip("H100 PCIe", 80 * GIB, 756e12, 2000 * GB, 600 * GB, 400e9 / 8, "NVLink", 8, "9.0"),
    # NVIDIA H200 datasheet: 141 GB HBM3e (140 GiB usable, nvidia-smi) at 4.8 TB/s, same compute
    # and NVLink as H100 SXM; 400 Gbps per GPU (DGX H200, GCP A3 Ultra).
    Chip("H200", 140 * GIB, 989e12, 4800 * GB, 900 * GB, 400e9 / 8, "NVLink", 8, "9.0"),
    # NVIDIA A100 datasheet (SXM4 80 GB): HBM2e at 2039 GB/s, 312 TFLOP/s bf16, NVLink 600 GB/s;
    # 200 Gbps HDR NIC per GPU (DGX A100).
    Chip("A100", 80 * GIB, 312e12, 2039 * GB, 600 * GB, 200e9 / 8, "NVLink", 8, "8.0"),
)}

# The GPUs' names in targets (`h100:2x8`, jaxscale/plan/targets.py; launch.fit --gpu) -> table keys.
GPU_CHIPS = {"h100": "H100 SXM", "h200": "H200", "a100": "A100"}

# `jax.Device.device_kind` strings -> table keys, searched in order (the more specific first:
# "H100 PCIe" before any H100, "TPU v5 lite" before the bare "TPU v5" that JAX reports for v5p).
_DEVICE_KIND_PATTERNS = (
    (r"h100.*pcie", "H100 PCIe"),
    (r"h100", "H100 SXM"),
    (r"h200", "H200"),
    (r"a100", "A100"),
    (r"tpu v4\b(?! ?lite)", "TPU v4"),
    (r"tpu v5 ?(lite|e)", "TPU v5e"),
    (r"tpu v5p?\b", "TPU v5p"),
    (r"tpu v6 ?(lite|e)", "TPU v6e"),
)


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The table's entry for a `jax.Device.device_kind`, or None for CPUs and unknown chips."""
    kind = device_kind.lower()
    for pattern, name in _DEVICE_KIND_PATTERNS:
        if re.search(pattern, kind):
            return CHIPS[name]
    return None


def peak_flops_per_device(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this kind, or None for CPUs and unknown chips."""
    chip = chip_for_device_kind(device_kind)
    return chip.peak_bf16_flops if chip else None
