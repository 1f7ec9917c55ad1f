"""`mesh.auto_trials`: the planner's compiled candidates timed on the devices at hand.

The planner ranks layouts by a model (FLOPs at peak, memory traffic over the HBM bandwidth as one
roofline over the whole program, collectives over the links), so two layouts within a few
percent of each other can rank the wrong way round (on an H100, `llama_1b` with remat none was
predicted 3% faster than save_dots and measured 6% slower; benchmarks/RESULTS.md). When the run's
own devices are the target, a few steps of each compiled candidate settle it: each is run from
random parameters on random tokens, and the fastest step wins.

A trial is one candidate compiled and timed here (`seconds_per_step`: a warm-up step, then the
median of `STEPS_TIMED`); `mesh.auto_trials` bounds how many are timed. Which candidates they are
(a spread of distinct meshes among the near-ties, then the ranked order) is the planner's
choice: `jaxscale.plan.planner.spread_order`.
"""

from __future__ import annotations

import gc
import statistics
import time

import jax
import ml_collections
import numpy as np

from jaxscale.checks import checked_mesh
from jaxscale.runtime.agreement import process_0_decides
from jaxscale.training.program import TrainProgram
from jaxscale.training.step import BATCH_KEYS

STEPS_TIMED = 3  # after one warm-up step; the median is kept


def random_batch(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    """One global batch of random tokens, one document per row: what a step's speed depends on
    (its shapes) without reading any data."""
    t = config.train
    rng = np.random.default_rng(t.seed)
    shape = (t.batch_size, t.seq_len)
    tokens = rng.integers(0, config.model.vocab_size, size=(t.batch_size, t.seq_len + 1),
                          dtype=np.int32)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                 segment_ids=np.ones(shape, np.int32), loss_mask=np.ones(shape, np.float32),
                 positions=np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), shape))
    return {key: batch[key] for key in BATCH_KEYS}


def seconds_per_step(config: ml_collections.ConfigDict, devices,
                     executable: jax.stages.Compiled) -> float:
    """The median time of `executable`, the train step of `config` compiled for `devices`, over
    `STEPS_TIMED` steps after a warm-up one. Every process of a multi-host run takes part."""
    tokens = random_batch(config)
    mesh = checked_mesh(config, devices)
    program = TrainProgram(config, mesh)
    state = program.init_state(config.train.seed)
    batch = {k: jax.make_array_from_callback(v.shape, program.batch_sharding,
                                             lambda index, v=v: v[index])
             for k, v in tokens.items()}
    times = []
    for _ in range(STEPS_TIMED + 1):
        start = time.perf_counter()
        state = jax.block_until_ready(executable(state, batch))[0]
        times.append(time.perf_counter() - start)
    del state, batch, program
    gc.collect()  # frees this candidate's state before the next one is allocated
    return statistics.median(times[1:])


def agreed(seconds: list[float]) -> list[float]:
    """Process 0's timings on every process, so that all choose the same layout."""
    return [float(s) for s in process_0_decides(np.asarray(seconds))]
