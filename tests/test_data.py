"""The input pipeline: determinism, batch layout, packing, splits, process shards, resume."""

import json

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.config import default_config
from jaxscale.data import Input, make_input, packing, pipeline, sources
from jaxscale.data.tokenizers import ByteTokenizer
from jaxscale.errors import JaxscaleError

BOS = ByteTokenizer.bos_id


def small_config(source="stdlib", seed=0):
    config = default_config()
    config.train.batch_size = 8
    config.train.seq_len = 64
    config.train.seed = seed
    config.data.source = source
    return config


@pytest.fixture(scope="module")
def batch_sharding():
    mesh = Mesh(np.array(jax.devices()), ("data",))
    return NamedSharding(mesh, PartitionSpec("data"))


def take(config, split, sharding, n):
    it = make_input(config, split, sharding)
    try:
        return [jax.device_get(next(it)) for _ in range(n)]
    finally:
        it.close()


def assert_same(batches_a, batches_b):
    for a, b in zip(batches_a, batches_b, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_same_seed_same_batches_other_seed_other_batches(batch_sharding, source):
    first = take(small_config(source, seed=1), "train", batch_sharding, 3)
    assert_same(first, take(small_config(source, seed=1), "train", batch_sharding, 3))
    other = take(small_config(source, seed=2), "train", batch_sharding, 3)
    assert not np.array_equal(first[0]["inputs"], other[0]["inputs"])


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_batch_layout(batch_sharding, source):
    config = small_config(source)
    it = make_input(config, "train", batch_sharding)
    batch = next(it)
    it.close()
    expected = {"inputs": np.int32, "targets": np.int32, "loss_mask": np.float32,
                "segment_ids": np.int32, "positions": np.int32}
    assert {k: v.dtype for k, v in batch.items()} == expected
    for array in batch.values():
        assert isinstance(array, jax.Array)
        assert array.shape == (config.train.batch_size, config.train.seq_len)
        assert array.sharding == batch_sharding
    vocab = ByteTokenizer.vocab_size
    assert 0 <= int(batch["inputs"].min()) and int(batch["inputs"].max()) < vocab


def check_packed_rows(batch):
    inputs, targets = batch["inputs"], batch["targets"]
    segments, positions = batch["segment_ids"], batch["positions"]
    same_document = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    # Next-token pairs: within a document the next input is this position's target.
    np.testing.assert_array_equal(targets[:, :-1][same_document], inputs[:, 1:][same_document])
    # Positions count up inside a document and restart with each new one.
    np.testing.assert_array_equal(positions[:, 1:][same_document],
                                  positions[:, :-1][same_document] + 1)
    new_document = (segments[:, 1:] != segments[:, :-1]) & (segments[:, 1:] != 0)
    np.testing.assert_array_equal(positions[:, 1:][new_document], 0)
    # A document starts with BOS everywhere except at a row's start, where it may continue one
    # cut at the previous row's end.
    np.testing.assert_array_equal(inputs[:, 1:][new_document], BOS)
    np.testing.assert_array_equal(positions[inputs == BOS], 0)
    assert (np.diff(segments, axis=1)[segments[:, 1:] != 0] >= 0).all()
    assert (segments[:, 0] == 1).all()
    np.testing.assert_array_equal(batch["loss_mask"], (segments != 0).astype(np.float32))


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_packed_rows_are_consistent(batch_sharding, source):
    for batch in take(small_config(source), "train", batch_sharding, 4):
        check_packed_rows(batch)
        # Several documents per row: the synthetic ones are at most 2 * seq_len long.
        if source == "synthetic":
            assert batch["segment_ids"].max() > 1


def test_padding_is_masked():
    documents = grain.MapDataset.source([np.full(5, 7, np.int32)])
    pairs = packing.next_token_pairs(documents, BOS, ByteTokenizer.eos_id).to_iter_dataset()
    (row,) = list(packing.concat_then_split(pairs, seq_len=10))
    np.testing.assert_array_equal(row["segment_ids"], [1] * 6 + [0] * 4)
    np.testing.assert_array_equal(row["loss_mask"], [1] * 6 + [0] * 4)
    np.testing.assert_array_equal(row["inputs"][:6], [BOS, 7, 7, 7, 7, 7])
    np.testing.assert_array_equal(row["targets"][:6], [7, 7, 7, 7, 7, ByteTokenizer.eos_id])


def test_attention_mask_is_causal_and_within_segments():
    segment_ids = np.array([[1, 1, 2, 2, 2, 0]])
    mask = np.asarray(packing.attention_mask_from_segments(segment_ids))[0]
    expected = np.array([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=bool)
    np.testing.assert_array_equal(mask, expected)


def test_eval_files_are_disjoint_from_train_files():
    _, paths = sources.stdlib_files()
    assert paths == sorted(paths) and len(paths) > 100
    assert not any("site-packages" in p for p in paths)
    held_out = {p for p in paths if sources.in_eval_split(p, 0.02)}
    assert 0 < len(held_out) < 0.05 * len(paths)
    # The split depends on the name only, not on which other files exist.
    assert held_out == {p for p in reversed(paths[::2] + paths[1::2])
                        if sources.in_eval_split(p, 0.02)}
    train = pipeline.documents(small_config(), "train", ByteTokenizer())
    evaluation = pipeline.documents(small_config(), "eval", ByteTokenizer())
    assert len(train) + len(evaluation) == len(paths)
    assert len(evaluation) == len(held_out)


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_eval_gives_the_same_batches_each_time(batch_sharding, source):
    config = small_config(source)
    evaluation = take(config, "eval", batch_sharding, 2)
    assert_same(evaluation, take(config, "eval", batch_sharding, 2))
    train = take(config, "train", batch_sharding, 1)
    assert not np.array_equal(evaluation[0]["inputs"], train[0]["inputs"])


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_restored_state_resumes_at_the_next_batch(batch_sharding, source):
    config = small_config(source)
    it = make_input(config, "train", batch_sharding)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as the checkpoint stores it
    expected = [jax.device_get(next(it)) for _ in range(4)]
    it.close()
    resumed = make_input(config, "train", batch_sharding)
    resumed.set_state(state)
    assert_same(expected, [jax.device_get(next(resumed)) for _ in range(4)])
    resumed.close()


def test_state_restores_between_documents(batch_sharding):
    # Documents that end exactly at a row's end leave no remainder in the packer's state; that
    # state must survive JSON too (grain compares its slices with tuples).
    documents = grain.MapDataset.source([np.full(7, i, np.int32) for i in range(3, 40)])
    pairs = packing.next_token_pairs(documents, BOS, ByteTokenizer.eos_id)

    def rows():
        return packing.concat_then_split(pairs.to_iter_dataset(), seq_len=8).batch(8)

    it = Input(rows(), batch_sharding, process_count=1, workers=0)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = jax.device_get(next(it))
    resumed = Input(rows(), batch_sharding, process_count=1, workers=0)
    resumed.set_state(state)
    assert_same([expected], [jax.device_get(next(resumed))])


def test_state_from_another_process_count_is_refused(batch_sharding):
    it = make_input(small_config(), "train", batch_sharding)
    state = it.get_state()
    state["process_count"] = 2
    with pytest.raises(JaxscaleError, match="process_count=2"):
        it.set_state(state)
    it.close()


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
@pytest.mark.parametrize("process_count", [1, 2, 4])
def test_process_shards_are_disjoint_and_cover_all_documents(source, process_count):
    config = small_config(source)
    everything = pipeline.documents(config, "train", ByteTokenizer())
    # Documents are identified by their position in the one epoch every process lists.
    indices = grain.MapDataset.range(len(everything))
    shards = [list(pipeline.process_shard(indices, i, process_count))
              for i in range(process_count)]
    seen = [i for shard in shards for i in shard]
    assert sorted(seen) == list(range(len(everything)))


@pytest.mark.parametrize("process_count", [2, 4])
def test_each_process_makes_its_share_of_the_batch(process_count):
    config = small_config("synthetic")
    firsts = []
    for index in range(process_count):
        it = iter(pipeline.local_batches(config, "train", index, process_count))
        batch = next(it)
        it.close()
        assert batch["inputs"].shape == (config.train.batch_size // process_count,
                                         config.train.seq_len)
        firsts.append(batch["inputs"].tobytes())
    assert len(set(firsts)) == process_count
