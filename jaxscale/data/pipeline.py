"""The grain pipeline of one process: its shard of each source -> mixture -> packed batches.

    per source: documents of the split -> this process's shard -> shuffled per epoch -> repeated
    weighted mixture -> [worker processes: read, tokenize, frame] -> drop skipped records
    -> pack into rows -> batch -> prefetch on a thread
"""

from __future__ import annotations

import grain
import ml_collections
import numpy as np
from absl import flags

from jaxscale.data import packing, sources
from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
from jaxscale.errors import ConfigError, JaxscaleError

# Documents read ahead by threads in each process (or worker). A document makes many rows, so a
# small window keeps the packer fed without holding many files in memory.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)
# With data.workers=-1: worker processes for tokenizers that cost real CPU. A function of the
# config only (not of the machine), because the iterator state depends on the worker count.
_AUTO_WORKERS_LEARNED_TOKENIZER = 2


def resolved_workers(config: ml_collections.ConfigDict, tokenizer) -> int:
    if config.data.workers >= 0:
        return config.data.workers
    return 0 if isinstance(tokenizer, ByteTokenizer) else _AUTO_WORKERS_LEARNED_TOKENIZER


def process_shard(dataset: grain.MapDataset, process_index: int,
                  process_count: int) -> grain.MapDataset:
    """Every `process_count`-th document from `process_index`: disjoint shards that cover all."""
    shard = dataset[process_index::process_count]
    if len(shard) == 0:
        raise JaxscaleError(f"the data has {len(dataset)} documents, too few to give each of "
                            f"{process_count} processes one; add data or use fewer processes")
    return shard


def local_batch_size(config: ml_collections.ConfigDict, process_count: int) -> int:
    batch_size = config.train.batch_size
    if batch_size % process_count:
        raise ConfigError(f"train.batch_size={batch_size} is not divisible by the {process_count} "
                          "processes; make it a multiple of the process count")
    return batch_size // process_count


def _shuffle_seed(seed: int, source: int, stream: int) -> int:
    return int(np.random.SeedSequence([seed, source, stream]).generate_state(1)[0])


def mixture(config: ml_collections.ConfigDict, split: str, process_index: int,
            process_count: int, tokenizer, stream: int = 0) -> grain.MapDataset:
    """This process's endless, weighted mixture of its shards of every source's `split`.

    Train: each source's shard is reshuffled every epoch from (train.seed, source, stream, epoch).
    Eval: fixed order, so every fresh iterator yields the same documents; it repeats too, so any
    number of eval batches exists. Weights are shares of documents, not of tokens.
    """
    if split not in sources.SPLITS:
        raise ValueError(f"split={split!r}; use one of {sources.SPLITS}")
    specs = sources.source_specs(config)
    frame = packing.NextTokenPairs(tokenizer.bos_id if config.data.add_bos else None,
                                   tokenizer.eos_id if config.data.add_eos else None)
    shards = []
    for i, spec in enumerate(specs):
        shard = process_shard(sources.source_documents(spec, split, tokenizer, config),
                              process_index, process_count)
        if split == "train":
            shard = shard.shuffle(seed=_shuffle_seed(config.train.seed, i, stream))
        shards.append(shard.repeat().map(frame))
    if len(shards) == 1:
        return shards[0]
    return grain.MapDataset.mix(shards, weights=[spec["weight"] for spec in specs])


def local_batches(config: ml_collections.ConfigDict, split: str, process_index: int,
                  process_count: int, stream: int = 0) -> grain.IterDataset:
    """The endless stream of this process's batches of packed rows, as numpy arrays.

    `stream` > 0 starts a different, equally deterministic order (see `Input.set_state`).
    """
    tokenizer = tokenizer_from_config(config)
    documents = mixture(config, split, process_index, process_count, tokenizer, stream)
    # Skipped records stay None through the workers and are dropped after them, so every worker
    # count yields the same documents in the same order.
    pairs = documents.to_iter_dataset(_READ_OPTIONS, allow_nones=True)
    workers = resolved_workers(config, tokenizer)
    if workers:
        # grain's worker start-up reads its absl flags, which only a `python -m jaxscale.train`
        # run has parsed; elsewhere (tests, notebooks, benchmarks) their defaults are the intent.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        pairs = pairs.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers,
                                                               per_worker_buffer_size=16))
    pairs = pairs.filter(lambda pair: pair is not None)
    batch = local_batch_size(config, process_count)
    rows = packing.pack(pairs, config.data.packing, config.train.seq_len, rows_at_once=batch)
    batches = rows.batch(batch, drop_remainder=True)
    return grain.experimental.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=config.data.prefetch)
