"""The grain pipeline of one process: its shard of documents -> packed rows -> local batches."""

from __future__ import annotations

import grain
import ml_collections

from jaxscale.data import packing, sources
from jaxscale.data.tokenizers import ByteTokenizer
from jaxscale.errors import ConfigError, JaxscaleError

# Documents read ahead by threads in each process (or worker). A document makes many rows, so a
# small window keeps the packer fed without holding many files in memory.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


def make_tokenizer(config: ml_collections.ConfigDict) -> ByteTokenizer:
    return ByteTokenizer()


def documents(config: ml_collections.ConfigDict, split: str, tokenizer) -> grain.MapDataset:
    """One epoch of all documents of `split` (every process sees the same dataset)."""
    if split not in sources.SPLITS:
        raise ValueError(f"split={split!r}; use one of {sources.SPLITS}")
    if config.data.source == "stdlib":
        return sources.stdlib_documents(split, config.data.eval_fraction, tokenizer)
    if config.data.source == "synthetic":
        return sources.synthetic_documents(split, config.train.seed, tokenizer,
                                           max_length=2 * config.train.seq_len)
    raise ConfigError(f"data.source={config.data.source!r} is unknown; use 'stdlib' or "
                      "'synthetic'")


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


def local_batches(config: ml_collections.ConfigDict, split: str, process_index: int,
                  process_count: int) -> grain.IterDataset:
    """The endless stream of this process's batches of packed rows, as numpy arrays.

    Train: each epoch reshuffles the shard from (train.seed, epoch). Eval: fixed order, so every
    fresh iterator yields the same batches; it repeats too, so any number of eval batches exists.
    """
    tokenizer = make_tokenizer(config)
    shard = process_shard(documents(config, split, tokenizer), process_index, process_count)
    if split == "train":
        shard = shard.shuffle(seed=config.train.seed)
    pairs = packing.next_token_pairs(shard.repeat(), tokenizer.bos_id, tokenizer.eos_id)
    rows = packing.concat_then_split(pairs.to_iter_dataset(_READ_OPTIONS), config.train.seq_len)
    batches = rows.batch(local_batch_size(config, process_count), drop_remainder=True)
    if config.data.workers > 0:
        return batches.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=config.data.workers, per_worker_buffer_size=config.data.prefetch))
    return grain.experimental.ThreadPrefetchIterDataset(
        batches, prefetch_buffer_size=config.data.prefetch)
