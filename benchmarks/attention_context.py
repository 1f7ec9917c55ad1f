"""Attention with the length split over a context axis, on one NVIDIA GPU: cuDNN's kernel (the
document mask as a bias) against XLA's path, for the shards' load-balanced, non-contiguous tokens.

    python benchmarks/attention_context.py [--batch=2] [--length=4096] [--context=4]

One GPU cannot split the length, so this checks the two pieces a context axis runs: (1) each
shard's attention, its queries (a chunk pair of the load-balanced order) against all keys, with
cuDNN, against a float32 computation in the natural order; (2) `_context` itself, the
`shard_map` body with its gathers, on a one-device mesh, forward and backward, cuDNN against XLA
(relative error of the gradients, median time, compiled temporaries). Last line: `ratio: X` =
cuDNN's time / XLA's in (2).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from attention import packed_segment_ids, relative_error
from timing import median_seconds

from jaxscale.config import default_config
from jaxscale.parallel.attention import _context, attend
from jaxscale.parallel.context import load_balanced_order
from jaxscale.parallel.mesh import build_mesh
from jaxscale.parallel.sharding import rules_from_config, use_rules


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 in each run of one segment id, as packing makes them."""
    positions = np.zeros_like(segment_ids)
    for row, ids in zip(positions, segment_ids):
        starts = np.flatnonzero(np.diff(ids, prepend=-1))
        lengths = np.diff(np.append(starts, len(ids)))
        row[:] = np.arange(len(ids)) - np.repeat(starts, lengths)
    return positions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("batch", 2), ("length", 4096), ("context", 4), ("repeats", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args()
    if jax.devices()[0].platform != "gpu":
        print(f"error: this benchmark needs an NVIDIA GPU, and the devices are "
              f"{jax.devices()[0].platform}; run it on a GPU host", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    b, t, c = a.batch, a.length, a.context
    q = jnp.asarray(rng.standard_normal((b, t, 32, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, t, 8, 128)), jnp.bfloat16) for _ in range(2))
    segments = packed_segment_ids(rng, b, t, 8)
    order = load_balanced_order(t, c)
    q_o, k_o, v_o = (x[:, order] for x in (q, k, v))
    seg_o = jnp.asarray(segments[:, order])
    pos_o = jnp.asarray(document_positions(segments)[:, order])
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    want = attend(*wide, jnp.asarray(segments), "xla")[:, order]

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: batch {b} x {t} tokens, "
          f"32 heads (8 kv) of 128, context={c}, load-balanced order")
    for i in range(c):
        rows = slice(i * t // c, (i + 1) * t // c)
        mask = ((seg_o[:, rows, None] == seg_o[:, None, :])
                & (pos_o[:, None, :] <= pos_o[:, rows, None]))
        got = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(
            q, k, v, mask=m[:, None], implementation="cudnn"))(q_o[:, rows], k_o, v_o, mask)
        print(f"shard {i}: {t // c} queries against {t} keys, rel. error "
              f"{relative_error(got, want[:, rows]):.2e}")

    mesh = build_mesh(dict(context=1), {}, jax.devices()[:1])
    rules = rules_from_config(default_config().sharding.rules)

    def grads(kernel):
        def loss(q, k, v):
            return jnp.sum(jnp.sin(
                    _context(q, k, v, seg_o, pos_o, kernel).astype(jnp.float32)))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    seconds = {}
    with use_rules(mesh, rules):
        reference = grads("xla")(*(x.astype(jnp.float32) for x in (q_o, k_o, v_o)))[1]
        for kernel in ("xla", "cudnn"):
            fn = grads(kernel)
            error = relative_error(fn(q_o, k_o, v_o)[1], reference)
            temp = fn.lower(q_o, k_o, v_o).compile().memory_analysis().temp_size_in_bytes
            seconds[kernel] = median_seconds(fn, (q_o, k_o, v_o), a.repeats)
            print(f"_context {kernel:<5}: gradients rel. error {error:.2e}, "
                  f"{seconds[kernel] * 1e3:.2f} ms, temporaries {temp / 2**20:.0f} MiB")
    print(f"ratio: {seconds['cudnn'] / seconds['xla']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
