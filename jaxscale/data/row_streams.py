"""Row streams: the global batch as `train.batch_size` independent streams of packed rows.

    per source: documents of the split -> stream r's share (r, r+S, r+2S, ...) -> shuffled per
    epoch -> repeated; weighted mixture -> read, tokenize, frame -> drop skipped records
    -> pack into rows -> one row per step

Row r of every global batch comes from stream r, whichever process builds it, so the global batch
is a function of (config, step) alone. A process builds only the streams of the rows it holds.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import grain
import jax
import ml_collections
import numpy as np

from jaxscale.data import packing, sources
from jaxscale.data.specs import has_chat, source_specs
from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
from jaxscale.errors import JaxscaleError
from jaxscale.runtime.storage import in_bucket

# From a local disk each stream reads synchronously (a read is microseconds): hundreds of streams
# with reader threads each would be thousands of threads. Parallelism comes from reading different
# streams at once (`data.workers`).
_SYNCHRONOUS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
# With data.workers=-1: reader threads for tokenizers that cost real CPU (they release the GIL).
_AUTO_WORKERS_LEARNED_TOKENIZER = 4
# first_fit: the rows a stream fills at once. More rows pad less but hold more documents back.
FIRST_FIT_ROWS = 8


def _read_options(config: ml_collections.ConfigDict) -> grain.ReadOptions:
    """With a source in a bucket, each stream reads `data.read_ahead` documents ahead of its rows,
    on a thread of its own: a ranged GET's round trip (a millisecond alone, ten and more while
    packing threads hold the GIL, which Python hands over every 5 ms) then overlaps the packing of
    the rows before it, where read on demand it stalled every batch that needed a new document.
    grain's state is the next document returned either way, so the batches and a resume are
    those of local disk."""
    if config.data.read_ahead and reads_a_bucket(config):
        return grain.ReadOptions(num_threads=1, prefetch_buffer_size=config.data.read_ahead)
    return _SYNCHRONOUS


def reads_a_bucket(config: ml_collections.ConfigDict) -> bool:
    return any(in_bucket(spec.get(key) or "") for spec in source_specs(config)
               for key in ("path", "eval_path"))


def resolved_workers(config: ml_collections.ConfigDict, tokenizer) -> int:
    if config.data.workers >= 0:
        return config.data.workers
    return 0 if isinstance(tokenizer, ByteTokenizer) else _AUTO_WORKERS_LEARNED_TOKENIZER


def local_rows(batch_sharding: jax.sharding.Sharding, batch_size: int, seq_len: int
               ) -> list[int]:
    """The global rows this process holds, in the order `make_array_from_process_local_data`
    expects them: ascending."""
    rows = set()
    for index in batch_sharding.addressable_devices_indices_map((batch_size, seq_len)).values():
        rows.update(range(batch_size)[index[0]])
    return sorted(rows)


def stream_share(documents: grain.MapDataset, stream: int, streams: int) -> grain.MapDataset:
    """Documents `stream`, `stream + streams`, ...: disjoint shares that cover every document.

    With fewer documents than streams, every stream reads all of them, starting at a different
    one, so rows still differ.
    """
    n = len(documents)
    if n >= streams:
        return documents[stream::streams]
    start = stream % n
    return documents.repeat(2)[start:start + n]


def _shuffle_seed(seed: int, source: int, stream: int) -> int:
    return int(np.random.SeedSequence([seed, source, stream]).generate_state(1)[0])


def mixture(config: ml_collections.ConfigDict, split: str, stream: int, tokenizer,
            documents: Sequence[grain.MapDataset] | None = None) -> grain.MapDataset:
    """Stream `stream`'s endless, weighted mixture of its share of every source's `split`.

    Train: each share is reshuffled every epoch from (train.seed, source, stream, epoch). Eval:
    fixed order, so every fresh iterator yields the same documents; it repeats too, so any number
    of eval batches exists. Weights are shares of documents, not of tokens. `documents`: every
    source's documents of `split`, when the caller has them already (listing is not free).
    """
    if split not in sources.SPLITS:
        raise ValueError(f"split={split!r}; use one of {sources.SPLITS}")
    specs = source_specs(config)
    if documents is None:
        documents = [sources.source_documents(spec, split, tokenizer, config) for spec in specs]
    frame = packing.NextTokenPairs(tokenizer.bos_id if config.data.add_bos else None,
                                   tokenizer.eos_id if config.data.add_eos else None,
                                   masked=has_chat(specs))
    shares = []
    for i, source in enumerate(documents):
        share = stream_share(source, stream, config.train.batch_size)
        if split == "train":
            share = share.shuffle(seed=_shuffle_seed(config.train.seed, i, stream))
        shares.append(share.repeat().map(frame))
    if len(shares) == 1:
        return shares[0]
    return grain.MapDataset.mix(shares, weights=[spec["weight"] for spec in specs])


class _NothingInARow:
    """The filter that drops a stream's skipped documents (None: malformed, too long for a row,
    too short to predict anything), and stops the run when `limit` come in a row: the stream then
    went through its whole share of every source without a document to train on, and would wait
    for a row forever. (A skipped record counts once in data.max_bad_records, however often it is
    read, so that limit alone cannot end such a wait.)"""

    def __init__(self, limit: int, where: str):
        self._limit, self._where, self._in_a_row = limit, where, 0

    def __call__(self, pair: dict | None) -> bool:
        if pair is not None:
            self._in_a_row = 0
            return True
        self._in_a_row += 1
        if self._in_a_row > self._limit:
            raise JaxscaleError(
                f"{self._where}: {self._in_a_row} documents in a row were skipped (malformed, too "
                "long for a row, or empty), every one of its share of the data: there is nothing "
                "to train on; fix the data (see the warnings and data_skipped_records) or raise "
                "train.seq_len")
        return False


def _pass_length(config: ml_collections.ConfigDict, stream: int,
                 documents: Sequence[grain.MapDataset]) -> int:
    """Twice the number of documents stream `stream` reads, at the most, before it has read its
    whole share of every source: a source drawn a fraction w of the time passes over its share
    of n documents in n / w draws."""
    weights = np.asarray([spec["weight"] for spec in source_specs(config)], float)
    shares = [len(stream_share(source, stream, config.train.batch_size)) for source in documents]
    return int(2 * max(n / w for n, w in zip(shares, weights / weights.sum()))) + 1


def row_stream(config: ml_collections.ConfigDict, split: str, stream: int, tokenizer,
               documents: Sequence[grain.MapDataset]) -> grain.IterDataset:
    """The endless rows of stream `stream`: row `stream` of every global batch, from every
    source's `documents` of `split`."""
    pairs = mixture(config, split, stream, tokenizer, documents).to_iter_dataset(
        _read_options(config), allow_nones=True)
    pairs = pairs.filter(_NothingInARow(_pass_length(config, stream, documents),
                                        f"{split} row stream {stream}"))
    chat = has_chat(source_specs(config))
    return packing.pack(pairs, packing.method_for(config.data.packing, chat),
                        config.train.seq_len, rows_at_once=FIRST_FIT_ROWS,
                        max_segments=config.data.max_segments, masked=chat)


def local_batches(config: ml_collections.ConfigDict, split: str, rows: Sequence[int],
                  skipped: sources.SkippedRecords) -> grain.IterDataset:
    """The endless batches of global rows `rows` (numpy, stacked in that order), prefetched on a
    thread; malformed records are counted in `skipped`. Its state is {str(row): that stream's
    state}."""
    tokenizer = tokenizer_from_config(config)
    documents = [sources.source_documents(spec, split, tokenizer, config, skipped)
                 for spec in source_specs(config)]
    streams = {row: row_stream(config, split, row, tokenizer, documents) for row in rows}
    batches = _StackedRows(streams, resolved_workers(config, tokenizer))
    return grain.experimental.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=config.data.prefetch)


class _StackedRows(grain.IterDataset):
    """One row from each stream per element, stacked."""

    def __init__(self, streams: dict[int, grain.IterDataset], workers: int):
        super().__init__(list(streams.values()))
        self._rows, self._workers = list(streams), workers

    def __iter__(self) -> _StackedRowsIterator:
        return _StackedRowsIterator(self._rows, [iter(s) for s in self.parents], self._workers)


class _StackedRowsIterator(grain.DatasetIterator):

    def __init__(self, rows: list[int], streams: list[grain.DatasetIterator], workers: int):
        super().__init__(streams)
        self._keys = [str(row) for row in rows]
        # Each stream is read by one thread at a time and its rows are stacked in row order, so
        # the batches are the same for any number of threads.
        self._pool = concurrent.futures.ThreadPoolExecutor(workers) if workers else None

    def __next__(self) -> dict[str, np.ndarray]:
        if self._pool is None:
            rows = [next(stream) for stream in self._parents]
        else:
            rows = list(self._pool.map(next, self._parents))
        return {name: np.stack([row[name] for row in rows]) for name in rows[0]}

    def get_state(self) -> dict[str, Any]:
        return {key: stream.get_state() for key, stream in zip(self._keys, self._parents)}

    def set_state(self, state: dict[str, Any]) -> None:
        for key, stream in zip(self._keys, self._parents):
            stream.set_state(state[key])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()
