"""The trainer's input: an iterator of global, sharded batches with a checkpointable position.

    it = make_input(config, "train", batch_sharding)
    batch = next(it)          # dict of global jax.Arrays, [train.batch_size, train.seq_len]
    state = it.get_state()    # small, JSON-serializable; store it with the checkpoint
    it.set_state(state)       # the next batch is the one an uninterrupted run would get
    it.close()                # stops prefetch threads and worker processes

Batch keys: `inputs`, `targets` (int32 next-token pairs), `loss_mask` (float32, 0 on padding),
`segment_ids` (int32, 1, 2, ... per packed document, 0 on padding), `positions` (int32, from 0 in
each document). See docs/data.md.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_collections

from jaxscale.data.pipeline import local_batches, resolved_workers
from jaxscale.data.tokenizers import tokenizer_from_config
from jaxscale.errors import JaxscaleError

__all__ = ["Input", "make_input"]

_STATE_VERSION = 1
LAYOUT_CHANGES = ("error", "restart")


class Input:
    """One process's batches of `split`, as global arrays laid out by `batch_sharding`."""

    def __init__(self, config: ml_collections.ConfigDict, split: str,
                 batch_sharding: jax.sharding.NamedSharding, process_index: int,
                 process_count: int):
        self._config, self._split, self._sharding = config, split, batch_sharding
        self._process_index, self._process_count = process_index, process_count
        self._workers = resolved_workers(config, tokenizer_from_config(config))
        self._batches = 0
        self._start(stream=0)

    def _start(self, stream: int) -> None:
        self._stream = stream
        self._iterator = iter(local_batches(self._config, self._split, self._process_index,
                                            self._process_count, stream))

    def __iter__(self) -> Input:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = next(self._iterator)
        self._batches += 1
        return {name: jax.make_array_from_process_local_data(self._sharding, array)
                for name, array in local.items()}

    def get_state(self) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "process_count": self._process_count,
            "workers": self._workers,
            "batches": self._batches,  # the same on every process: they step together
            "stream": self._stream,
            "pipeline": self._iterator.get_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes where `state` was taken.

        Each process reads its own shard and grain workers split it further, so a position saved
        under another process or worker count names other data. Then, by data.on_layout_change:
        "error" refuses; "restart" starts a new deterministic order (a function of train.seed
        and the batch count, so every process agrees), which may repeat or skip documents of the
        interrupted epoch.
        """
        if state.get("version") != _STATE_VERSION:
            raise JaxscaleError(f"data iterator state version {state.get('version')!r} is not "
                                f"{_STATE_VERSION}; it was written by another jaxscale version")
        self._batches = state["batches"]
        saved = {"process_count": state["process_count"], "workers": state["workers"]}
        now = {"process_count": self._process_count, "workers": self._workers}
        if saved == now:
            if state["stream"] != self._stream:
                self.close()
                self._start(state["stream"])
            self._iterator.set_state(_slices_as_tuples(state["pipeline"]))
            return
        if self._config.data.on_layout_change != "restart":
            changed = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in saved if saved[k] != now[k])
            raise JaxscaleError(
                f"cannot resume the data exactly: {changed}; resume with the saved counts, or "
                "set data.on_layout_change='restart' to continue in a new deterministic order")
        self.close()
        self._start(stream=state["batches"])

    def close(self) -> None:
        """Stops prefetch threads and worker processes."""
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
    return Input(config, split, batch_sharding, jax.process_index(), jax.process_count())
