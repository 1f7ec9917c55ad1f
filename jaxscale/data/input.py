"""One process's share of the global batches of a split, as sharded global arrays with a
checkpointable position (`Input`, `make_input`); the eval split opened once per run (`HeldOut`);
and the data section's checks at start-up (`check_data`). The rows come from row_streams.py."""


from __future__ import annotations

import json
from typing import Any

import jax
import ml_collections
import numpy as np

from jaxscale.data.chat import ChatEncoder
from jaxscale.data.packing import AUTO, METHODS
from jaxscale.data.row_streams import local_batches, local_rows
from jaxscale.data.sources import SkippedRecords, source_specs
from jaxscale.data.tokenizers import tokenizer_from_config
from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.parallel.context import length_shards, load_balanced
from jaxscale.runtime.agreement import gathered, gathered_bytes

_STATE_VERSION = 2


class Input:
    """One process's batches of `split`, as global arrays laid out by `batch_sharding`.

    Row r of every global batch comes from row stream r (see row_streams.py); this process builds
    the streams of the rows `batch_sharding` places on its devices. When `batch_sharding` splits
    the length (the context axis), each row's tokens are put in the load-balanced order of
    jaxscale/parallel/context.py here, the one place every train and eval batch passes through on
    its way to the devices, on the host, before the stream state that a checkpoint keeps.
    """

    def __init__(self, config: ml_collections.ConfigDict, split: str,
                 batch_sharding: jax.sharding.Sharding):
        self._config, self._sharding = config, batch_sharding
        self._batch_size = config.train.batch_size
        self._shape = (self._batch_size, config.train.seq_len)
        self._context = length_shards(batch_sharding, self._shape)
        self.rows = local_rows(batch_sharding, *self._shape)
        self._skipped = SkippedRecords()
        self._iterator = iter(local_batches(config, split, self.rows, self._skipped))
        self._batches = 0

    def __iter__(self) -> Input:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        local = load_balanced(next(self._iterator), self._context)
        self._batches += 1
        # The global shape, given, lets a process whose devices hold only some of the length
        # shards pass its whole rows: each device takes its slice of them.
        return {name: jax.make_array_from_process_local_data(self._sharding, array, self._shape)
                for name, array in local.items()}

    def skipped_records(self) -> int:
        """Malformed records skipped so far, summed over every process (each must call it)."""
        return int(gathered(np.int64(self._skipped.count)).sum())

    def get_state(self) -> dict[str, Any]:
        """The position of every row stream, on every process.

        With several processes this gathers the streams of all of them (every process must call
        it, as every process saves a checkpoint), so a checkpoint resumes under any process
        count: each process takes the streams of its rows from whichever state it reads.
        """
        return {
            "version": _STATE_VERSION,
            "batch_size": self._batch_size,
            "batches": self._batches,  # the same on every process: they step together
            "streams": _from_all_processes(self._iterator.get_state()),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes where `state` was taken: the next batch is the one an uninterrupted run would
        get, whatever the process count, mesh or `data.workers` then and now."""
        if state.get("version") != _STATE_VERSION:
            raise JaxscaleError(f"data iterator state version {state.get('version')!r} is not "
                                f"{_STATE_VERSION}; it was written by another jaxscale version")
        if state["batch_size"] != self._batch_size:
            raise JaxscaleError(
                f"cannot resume the data: the checkpoint has {state['batch_size']} row streams "
                f"(train.batch_size) but train.batch_size is now {self._batch_size}; resume with "
                "the saved batch size, or start a new run from its parameters "
                "(checkpoint.restore_from with checkpoint.restore_params_only=True)")
        missing = [row for row in self.rows if str(row) not in state["streams"]]
        if missing:
            raise JaxscaleError(f"the data state lacks the positions of rows {missing[:8]}; it "
                                "was not written by Input.get_state")
        self._batches = state["batches"]
        self._iterator.set_state({str(row): _slices_as_tuples(state["streams"][str(row)])
                                  for row in self.rows})

    def close(self) -> None:
        """Stops the prefetch and reader threads."""
        self._iterator.close()
        # Dropping the iterator now lets grain's own finalizer run while the interpreter is whole;
        # at exit it would fail noisily on torn-down modules.
        del self._iterator


def _from_all_processes(streams: dict[str, Any]) -> dict[str, Any]:
    """The union of every process's {row: stream state}: each process holds only its own."""
    if jax.process_count() == 1:
        return streams
    union = {}
    for encoded in gathered_bytes(json.dumps(streams).encode()):
        union.update(json.loads(encoded))
    return union


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
               batch_sharding: jax.sharding.Sharding) -> Input:
    """The `split` ("train" or "eval") input of this process, per `config.data`."""
    return Input(config, split, batch_sharding)


def check_data(config: ml_collections.ConfigDict) -> None:
    """ConfigError on the first problem of the data section: its sources' specs, the packing
    method, a tokenizer with more ids than the model's vocabulary, and for chat sources, their
    templates, the packing and the tokenizer they need."""
    d, m = config.data, config.model
    specs = source_specs(config)
    if d.packing not in (AUTO, *METHODS):
        raise ConfigError(f"data.packing={d.packing!r} is unknown; use one of {(AUTO, *METHODS)}")
    tokenizer = tokenizer_from_config(config)
    vocab = tokenizer.vocab_size
    if vocab > m.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's "
                          f"{vocab} ids; set model.vocab_size >= {vocab}")
    for spec in specs:
        if spec["format"] != "chat":
            continue
        # concat would cut conversations at row ends; first_fit keeps each whole in one row.
        if d.packing == "concat":
            raise ConfigError(f"data.packing={d.packing!r} cuts conversations where rows end; "
                              f"{spec['name']} is chat data: set data.packing='first_fit' (or "
                              f"{AUTO!r}, the default, which chooses it for chat data)")
        ChatEncoder(spec, tokenizer, config)  # its template compiles, its tokenizer fits


class HeldOut:
    """The eval split, opened once per run: every eval reads the same first batches, without
    listing the files or loading the tokenizer again."""

    def __init__(self, config: ml_collections.ConfigDict, sharding: jax.sharding.Sharding):
        self._input = make_input(config, "eval", sharding)
        self._start = self._input.get_state()

    def first_batches(self, count: int):
        self._input.set_state(self._start)
        for _ in range(count):
            yield next(self._input)

    def close(self) -> None:
        self._input.close()
