"""The trainer's input: an iterator of global, sharded batches with a checkpointable position.

    it = make_input(config, "train", batch_sharding)
    batch = next(it)          # dict of global jax.Arrays, [train.batch_size, train.seq_len]
    state = it.get_state()    # small, JSON-serializable; store it with the checkpoint
    it.set_state(state)       # the next batch is the one an uninterrupted run would get

Batch keys: `inputs`, `targets` (int32 next-token pairs), `loss_mask` (float32, 0 on padding),
`segment_ids` (int32, 1, 2, ... per packed document, 0 on padding), `positions` (int32, from 0 in
each document).
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import ml_collections

from jaxscale.data.pipeline import local_batches
from jaxscale.errors import JaxscaleError

__all__ = ["Input", "make_input"]

_STATE_VERSION = 1


class Input:
    """Turns one process's numpy batches into global arrays laid out by `batch_sharding`."""

    def __init__(self, dataset: grain.IterDataset, batch_sharding: jax.sharding.NamedSharding,
                 process_count: int, workers: int):
        self._iterator = iter(dataset)
        self._sharding = batch_sharding
        self._process_count = process_count
        self._workers = workers

    def __iter__(self) -> Input:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = next(self._iterator)
        return {name: jax.make_array_from_process_local_data(self._sharding, array)
                for name, array in local.items()}

    def get_state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "process_count": self._process_count,
            "workers": self._workers,
            "pipeline": self._iterator.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        # Each process reads its own shard, and grain workers split it further, so a position
        # saved under one layout names different data under another.
        for key, now in (("process_count", self._process_count), ("workers", self._workers)):
            if state[key] != now:
                raise JaxscaleError(
                    f"the data iterator state was saved with {key}={state[key]} but this run has "
                    f"{key}={now}; resume with {key}={state[key]}")
        self._iterator.set_state(_slices_as_tuples(state["pipeline"]))

    def close(self) -> None:
        """Stops prefetch threads and worker processes; the Input is unusable afterwards."""
        self._iterator.close()
        # Dropping the iterator now lets grain's own finalizer run while the interpreter is whole;
        # at exit it would fail noisily on torn-down modules.
        del self._iterator


def _slices_as_tuples(state: Any) -> Any:
    """grain's concat-then-split state holds (start, stop) tuples and tests them with `!=` against
    a tuple sentinel; after a JSON round trip they are lists, the test always passes and the
    restored position skips a document. Turning them back into tuples restores it exactly."""
    if isinstance(state, dict):
        return {key: ({k: tuple(v) for k, v in value.items()} if key == "remainder_slices"
                      else _slices_as_tuples(value))
                for key, value in state.items()}
    return state


def make_input(config: ml_collections.ConfigDict, split: str,
               batch_sharding: jax.sharding.NamedSharding) -> Input:
    """The `split` ("train" or "eval") input of this process, per `config.data`."""
    dataset = local_batches(config, split, jax.process_index(), jax.process_count())
    return Input(dataset, batch_sharding, jax.process_count(), config.data.workers)
