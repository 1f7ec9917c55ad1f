"""Attention on packed rows on an NVIDIA GPU: cuDNN's fused kernel, in its two forms for packed
rows, against XLA's path, which materialises the scores under a [batch, 1, T, T] document mask.

    python benchmarks/attention.py [--batch=4] [--length=2048] [--heads=32] [--kv_heads=8]
                                   [--head_dim=64] [--max_segments=32] [--repeats=20]

Each side computes a loss of the attention output and its gradients with respect to q, k and v
(bfloat16), on rows packed with random documents (`max_segments` runs per row, the last one
padding). First checks both against a float32 computation of the same masked attention
(relative error of outputs and gradients; bfloat16 inputs land near 1e-2 or below), then times
each side's forward and backward (median of `repeats` after warm-up) and reads the compiled
temporaries from `memory_analysis()`. The cuDNN forms (jaxscale/parallel/attention.py): the
document mask as a bias (data.max_segments=0, the default) and the packed layout
(data.max_segments=M). Also times cuDNN on causal rows without packing, the kernel's own speed.
Last line: `ratio: X` = cuDNN's time in the default (mask) form / XLA's. Needs a GPU; the packed
layout needs a Hopper GPU or newer.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_seconds

from jaxscale.parallel.attention import attend


def packed_segment_ids(rng, batch: int, length: int, max_segments: int) -> np.ndarray:
    """Rows of random documents, `max_segments - 1` at most, then padding (one run more)."""
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), size=max_segments - 1, replace=False))
        ids = np.searchsorted(cuts, np.arange(length), side="right") + 1
        ids[ids == max_segments] = 0  # the last run is padding
        rows.append(ids)
    return np.stack(rows).astype(np.int32)


def loss_and_grads(implementation: str, max_segments: int, packed: bool):
    def loss(q, k, v, segment_ids):
        out = attend(q, k, v, segment_ids if packed else None, implementation,
                     max_segments=max_segments)
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))  # every output position matters
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def relative_error(got, want) -> float:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return max(float(jnp.linalg.norm((a.astype(jnp.float32) - b).ravel())
                     / jnp.linalg.norm(b.ravel())) for a, b in pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 4), ("length", 2048), ("heads", 32), ("kv_heads", 8),
                          ("head_dim", 64), ("max_segments", 32), ("repeats", 20)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"error: this benchmark needs an NVIDIA GPU, and the devices are {device.platform}; "
              "run it on a GPU host", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    shape_q = (a.batch, a.length, a.heads, a.head_dim)
    shape_kv = (a.batch, a.length, a.kv_heads, a.head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in (shape_q, shape_kv, shape_kv))
    segment_ids = jnp.asarray(packed_segment_ids(rng, a.batch, a.length, a.max_segments))
    args = (q, k, v, segment_ids)
    wide = tuple(x.astype(jnp.float32) for x in (q, k, v)) + (segment_ids,)
    reference = loss_and_grads("xla", 0, True)(*wide)[1]

    print(f"{device.device_kind}, jax {jax.__version__}: batch {a.batch} x {a.length} tokens, "
          f"{a.heads} heads ({a.kv_heads} kv) of {a.head_dim}, {a.max_segments} runs a row")
    sides = {"xla": ("xla", a.max_segments, True),
             "cudnn, mask": ("cudnn", 0, True),
             "cudnn, packed layout": ("cudnn", a.max_segments, True),
             "cudnn, causal only": ("cudnn", a.max_segments, False)}
    print(f"{'side':<21} {'rel. error':>10} {'fwd+bwd ms':>11} {'temp MiB':>9}")
    seconds = {}
    for name, (implementation, max_segments, packed) in sides.items():
        fn = loss_and_grads(implementation, max_segments, packed)
        error = relative_error(fn(*args)[1], reference) if packed else float("nan")
        if packed and not error < 2e-2:
            print(f"error: {name} differs from the float32 reference by {error:.2e}",
                  file=sys.stderr)
            return 1
        memory = fn.lower(*args).compile().memory_analysis()
        seconds[name] = median_seconds(fn, args, a.repeats)
        print(f"{name:<21} {error:>10.2e} {seconds[name] * 1e3:>11.2f} "
              f"{memory.temp_size_in_bytes / 2**20:>9.1f}")
    print(f"ratio: {seconds['cudnn, mask'] / seconds['xla']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
