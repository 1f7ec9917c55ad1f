"""Context parallelism's load balance: the order of each row's tokens across the context shards.

With the sequence split over C devices in order, device i's queries see i + 1 chunks of causal
keys, so with a kernel that skips masked blocks (splash, cuDNN) the last device works C times as
hard as the first and the step waits for it. (The XLA path computes all scores and masks: the
same work in any order.) Cut into
2C chunks instead, device i holding chunks i and 2C - 1 - i: every device then has
(i + 1) + (2C - i) = 2C + 1 chunk-pairs of causal work.

The input pipeline (`jaxscale.data.Input`) applies the order once, to every array of a batch,
before the batch is laid out on the devices. `positions` move with their tokens and keep their true
values, so RoPE and the attention mask (built from positions, jaxscale/parallel/attention.py) see
the sequence as it was; the loss is a sum over tokens, which order does not change.
"""

from __future__ import annotations

import math

import jax
import ml_collections
import numpy as np

from jaxscale.errors import ConfigError


def load_balanced_order(length: int, shards: int) -> np.ndarray:
    """The token indices in the order they are laid out: shard i's slice of the result holds
    chunks i and 2·shards - 1 - i of the `length` tokens (the identity for one shard)."""
    if shards == 1:
        return np.arange(length)
    if length % (2 * shards):
        raise ValueError(f"a sequence of {length} tokens does not cut into 2 x {shards} chunks")
    chunks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]])
                           for i in range(shards)])


def length_shards(sharding: jax.sharding.Sharding, shape: tuple[int, int]) -> int:
    """How many pieces `sharding` cuts the length (second) dimension of a [batch, length] array
    into: the context degree of the batch layout."""
    return shape[1] // sharding.shard_shape(shape)[1]


def load_balanced(batch: dict[str, np.ndarray], shards: int) -> dict[str, np.ndarray]:
    """Every [batch, length] array of `batch` in `load_balanced_order` along its length."""
    if shards == 1:
        return batch
    order = load_balanced_order(next(iter(batch.values())).shape[1], shards)
    return {name: np.take(array, order, axis=1) for name, array in batch.items()}


def check_context(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """The sequence split over the axes of sharding.rules.length (mesh.context by default)."""
    axes = tuple(config.sharding.rules.get("length", ()))
    shards = math.prod(mesh_shape[a] for a in axes if a in mesh_shape)
    if shards == 1:
        return
    where = "x".join(f"mesh.{a}={mesh_shape[a]}" for a in axes if a in mesh_shape)
    seq_len = config.train.seq_len
    if seq_len % (2 * shards):
        raise ConfigError(
            f"train.seq_len={seq_len} is not divisible by 2 x {where} = {2 * shards}: the "
            f"sequence is cut into {2 * shards} chunks for a load-balanced causal attention; "
            f"make train.seq_len a multiple of {2 * shards}")
    if config.model.attention == "splash":
        raise ConfigError(
            f"model.attention='splash' needs whole sequences on each device, but {where} splits "
            "them (sharding.rules.length); use model.attention=auto, xla or (GPUs) cudnn")
