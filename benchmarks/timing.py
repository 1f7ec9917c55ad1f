"""Clocks the benchmark scripts share: a function's median time, and seconds per train step."""

from __future__ import annotations

import statistics
import time

import jax


def median_seconds(fn, args, repeats: int) -> float:
    """The median of `repeats` timed calls of `fn(*args)`, after two untimed ones (compile,
    warm-up)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def seconds_per_step(step, state, batch, steps: int):
    """`steps` calls of `step(state, batch)` in a row: (the last state, the mean seconds a step)."""
    begin = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return state, (time.perf_counter() - begin) / steps
