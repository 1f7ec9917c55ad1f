"""The input pipeline: determinism, batch layout, packing, splits, process shards, resume."""

import json

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.config import default_config
from jaxscale.data import make_input, packing, row_streams, sources
from jaxscale.data.specs import source_specs
from jaxscale.data.tokenizers import ByteTokenizer
from jaxscale.errors import JaxscaleError
from tests.helpers import model_attention_mask

BOS = ByteTokenizer.bos_id
EOS = ByteTokenizer.eos_id


def small_config(source="stdlib", seed=0, **data):
    config = default_config()
    config.train.batch_size = 8
    config.train.seq_len = 64
    config.train.seed = seed
    config.data.sources = (dict(format=source),)
    config.data.update(data)
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


def packed_rows(documents, method, seq_len, rows_at_once=1):
    pairs = grain.MapDataset.source(documents).map(packing.NextTokenPairs(BOS, EOS))
    return list(packing.pack(pairs.to_iter_dataset(), method, seq_len, rows_at_once))


@pytest.mark.parametrize("method", packing.METHODS)
def test_padding_is_masked(method):
    (row,) = packed_rows([np.full(5, 7, np.int32)], method, seq_len=10)
    np.testing.assert_array_equal(row["segment_ids"], [1] * 6 + [0] * 4)
    np.testing.assert_array_equal(row["loss_mask"], [1] * 6 + [0] * 4)
    np.testing.assert_array_equal(row["inputs"][:6], [BOS, 7, 7, 7, 7, 7])
    np.testing.assert_array_equal(row["targets"][:6], [7, 7, 7, 7, 7, EOS])


def test_first_fit_keeps_documents_whole():
    lengths = [3, 7, 2, 6, 9, 1, 4, 20]
    documents = [np.full(n, 10 + i, np.int32) for i, n in enumerate(lengths)]
    rows = packed_rows(documents, "first_fit", seq_len=10, rows_at_once=4)
    pieces = {}
    for row in rows:
        for segment in range(1, row["segment_ids"].max() + 1):
            inputs = row["inputs"][row["segment_ids"] == segment]
            pieces.setdefault(int(inputs.max()), []).append(len(inputs))
    pieces = {k: sorted(v) for k, v in pieces.items()}
    # Each document shorter than a row sits whole in one row (its pairs: length + 1); the
    # 20-token one is cut into row-sized pieces.
    assert pieces == {10 + i: [n + 1] for i, n in enumerate(lengths[:-1])} | {17: [1, 10, 10]}


def test_concat_leaves_no_padding_between_documents():
    documents = [np.full(n, 10 + i, np.int32) for i, n in enumerate([3, 7, 2, 6, 9, 1, 4, 20])]
    rows = packed_rows(documents, "concat", seq_len=10)
    assert all(r["loss_mask"].all() for r in rows[:-1])
    assert sum(int(r["loss_mask"].sum()) for r in rows) == sum(n + 1 for n in
                                                               [3, 7, 2, 6, 9, 1, 4, 20])


@pytest.mark.parametrize("method", packing.METHODS)
def test_max_segments_cuts_crowded_rows_and_keeps_every_document(method):
    """With max_segments=4 no row holds more than 4 runs (padding counted); the tokens the loss
    sees, with their positions, are the same stream as without the bound, in the same order."""
    rng = np.random.default_rng(0)
    documents = [np.full(n, 10 + i, np.int32) for i, n in enumerate(rng.integers(1, 6, 40))]

    def stream(rows):
        kept = [np.stack([r[k][r["loss_mask"] > 0] for k in ("inputs", "targets", "positions")])
                for r in rows]
        return np.concatenate(kept, axis=1)

    pairs = grain.MapDataset.source(documents).map(packing.NextTokenPairs(BOS, EOS))
    unbounded = packed_rows(documents, method, seq_len=32, rows_at_once=2)
    bounded = list(packing.pack(pairs.to_iter_dataset(), method, 32, 2, max_segments=4))
    runs = [len(np.flatnonzero(np.diff(r["segment_ids"], prepend=-1))) for r in bounded]
    assert max(runs) == 4 and len(bounded) > len(unbounded)
    np.testing.assert_array_equal(stream(bounded), stream(unbounded))
    for row in bounded:
        check_packed_rows({k: v[None] for k, v in row.items()})


def line_documents_config(tmp_path, lines: list[str]):
    """small_config reading `lines` from a text file, one document each."""
    path = tmp_path / "docs.txt"
    path.write_text("".join(f"{line}\n" for line in lines))
    config = small_config()
    config.data.sources = (dict(format="text", path=str(path), document="line"),)
    return config


def test_state_restores_inside_a_cut_row(batch_sharding, tmp_path):
    """A row cut into several by data.max_segments: a state taken between its pieces resumes
    at the next piece."""
    config = line_documents_config(tmp_path, [str(i) for i in range(400)])
    config.data.max_segments = 3
    it = make_input(config, "train", batch_sharding)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [jax.device_get(next(it)) for _ in range(3)]
    it.close()
    assert max(b["segment_ids"].max() for b in expected) == 2  # rows of at most 2 documents
    resumed = make_input(config, "train", batch_sharding)
    resumed.set_state(state)
    assert_same(expected, [jax.device_get(next(resumed)) for _ in range(3)])
    resumed.close()


def test_attention_mask_is_causal_and_within_segments():
    segment_ids = np.array([[1, 1, 2, 2, 2, 0]])
    mask = model_attention_mask(segment_ids)[0]
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
    mask = sources.held_out(paths, [1] * len(paths), 0.02)
    held_out = {p for p, m in zip(paths, mask) if m}
    assert 0 < len(held_out) < 0.05 * len(paths)
    # The split depends on the name only, not on which other files exist.
    shuffled = list(reversed(paths[::2] + paths[1::2]))
    assert held_out == {p for p, m in zip(shuffled, sources.held_out(shuffled, [1] * len(paths),
                                                                      0.02)) if m}
    spec = source_specs(small_config())[0]
    train = sources.source_documents(spec, "train", ByteTokenizer(), small_config())
    evaluation = sources.source_documents(spec, "eval", ByteTokenizer(), small_config())
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


def test_state_restores_between_documents(batch_sharding, tmp_path):
    # 7-byte documents framed by BOS/EOS make exactly one 8-token row each, so every state is
    # taken with nothing left over in the packer; that state must survive JSON too (grain
    # compares its slices with tuples).
    config = line_documents_config(tmp_path, [f"line{i:03d}" for i in range(200)])
    config.train.seq_len = 8
    it = make_input(config, "train", batch_sharding)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = jax.device_get(next(it))
    it.close()
    assert (expected["segment_ids"] == 1).all()
    resumed = make_input(config, "train", batch_sharding)
    resumed.set_state(state)
    assert_same([expected], [jax.device_get(next(resumed))])
    resumed.close()


def test_resume_with_another_batch_size_is_refused(batch_sharding):
    config = small_config("synthetic")
    it = make_input(config, "train", batch_sharding)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    it.close()
    config.train.batch_size = 16
    it = make_input(config, "train", batch_sharding)
    with pytest.raises(JaxscaleError, match="8 row streams.*batch_size is now 16"):
        it.set_state(state)
    it.close()


@pytest.mark.parametrize("streams", [1, 2, 7])
def test_row_stream_shares_are_disjoint_and_cover_all_documents(streams):
    # Documents are identified by their position in the one epoch every stream lists; an odd
    # count checks the uneven split too.
    documents = grain.MapDataset.range(1001)
    shares = [list(row_streams.stream_share(documents, stream, streams))
              for stream in range(streams)]
    assert sorted(i for share in shares for i in share) == list(range(1001))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_with_fewer_documents_than_streams_each_stream_reads_all_from_its_own_start():
    shares = [list(row_streams.stream_share(grain.MapDataset.range(3), stream, 8))
              for stream in range(8)]
    assert shares[:4] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]


def test_this_process_holds_every_row_of_a_one_process_mesh(batch_sharding):
    it = make_input(small_config("synthetic"), "train", batch_sharding)
    assert it.rows == list(range(8))
    it.close()


def process_rows(batch_size, process_count):
    """The rows each of `process_count` processes holds: contiguous blocks, as on the trainer's
    meshes (`jaxscale.data.row_streams.local_rows` reads them from the sharding)."""
    share = batch_size // process_count
    return [range(p * share, (p + 1) * share) for p in range(process_count)]


def global_batches(config, process_count, n, states=None):
    """`n` global batches as `process_count` processes would build them (each from its streams'
    positions in `states`, if given), and the union of their states after: what
    `Input.get_state` gathers."""
    per_process, union = [], {}
    for rows in process_rows(config.train.batch_size, process_count):
        it = iter(row_streams.local_batches(config, "train", rows, sources.SkippedRecords()))
        if states is not None:
            it.set_state({str(row): states[str(row)] for row in rows})
        per_process.append([next(it) for _ in range(n)])
        union.update(it.get_state())
        it.close()
    batches = [{name: np.concatenate([local[step][name] for local in per_process])
                for name in per_process[0][step]} for step in range(n)]
    return batches, union


MIXTURE = (dict(format="stdlib", weight=1), dict(format="synthetic", weight=3))


@pytest.mark.parametrize("method", packing.METHODS)
@pytest.mark.parametrize("sources_", [(dict(format="stdlib"),), MIXTURE],
                         ids=["stdlib", "mixture"])
def test_global_batches_do_not_depend_on_the_process_count(method, sources_):
    config = small_config(packing=method, sources=sources_)
    one_process, _ = global_batches(config, 1, 3)
    for process_count in (2, 4):
        assert_same(one_process, global_batches(config, process_count, 3)[0])


@pytest.mark.parametrize("method", packing.METHODS)
def test_a_state_saved_under_some_process_count_resumes_under_another(method):
    config = small_config(packing=method, sources=MIXTURE)
    uninterrupted, _ = global_batches(config, 1, 6)
    _, saved = global_batches(config, 2, 3)
    for process_count in (1, 4):
        assert_same(uninterrupted[3:], global_batches(config, process_count, 3, saved)[0])


def test_every_eval_reads_the_same_held_out_batches_as_a_fresh_input(batch_sharding):
    from jaxscale.data import HeldOut

    config = small_config()
    fresh = take(config, "eval", batch_sharding, 3)
    held_out = HeldOut(config, batch_sharding)
    try:
        for _ in range(2):  # two evals, the first having read ahead
            assert_same([jax.device_get(b) for b in held_out.first_batches(3)], fresh)
    finally:
        held_out.close()
