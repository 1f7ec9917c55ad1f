"""Data sources and tokenizers: every format round-trips a fixture; bad input fails in one line."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.checks import validate
from jaxscale.config import default_config
from jaxscale.data import make_input, prepare, row_streams, sources, token_files
from jaxscale.data.specs import source_specs
from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
from jaxscale.errors import ConfigError, JaxscaleError
from tests.helpers import TEXTS, config_with, model_attention_mask, one_line_error


def write_text_files(directory):
    directory.mkdir()
    for i, text in enumerate(TEXTS):
        (directory / f"{i:03d}.txt").write_text(text)
    return dict(format="text", path=str(directory / "*.txt"))


def write_lines(path):
    path.write_text("".join(t + "\n" for t in TEXTS))
    return dict(format="text", path=str(path), document="line")


def write_jsonl(path):
    path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS)))
    return dict(format="jsonl", path=str(path), text_field="body")


def write_parquet(path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")

    pq.write_table(pa.table({"text": TEXTS, "n": list(range(len(TEXTS)))}), path,
                   row_group_size=25)
    return dict(format="parquet", path=str(path))


def write_array_record(path):
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    for text in TEXTS:
        writer.write(text.encode())
    writer.close()
    return dict(format="array_record", path=str(path))


def write_tokens(path):
    stem = str(path)[:-len(".bin")]
    token_files.write_token_file(stem, [ByteTokenizer().encode(t) for t in TEXTS],
                                 ByteTokenizer.vocab_size, "byte")
    return dict(format="tokens", path=str(path))


FIXTURES = {
    "text_files": (write_text_files, "texts"),
    "text_lines": (write_lines, "texts.txt"),
    "jsonl": (write_jsonl, "texts.jsonl"),
    "parquet": (write_parquet, "texts.parquet"),
    "array_record": (write_array_record, "texts.array_record"),
    "tokens": (write_tokens, "texts.bin"),
}


def write_fixture(tmp_path, name):
    writer, file_name = FIXTURES[name]
    return writer(tmp_path / file_name)


def decoded(config, split):
    """The texts of the first source's `split`, in order."""
    documents = sources.source_documents(source_specs(config)[0], split,
                                         ByteTokenizer(), config)
    return [ByteTokenizer().decode(d) for d in documents]


@pytest.mark.parametrize("name", list(FIXTURES))
def test_every_format_round_trips(tmp_path, name):
    spec = write_fixture(tmp_path, name)
    config = config_with(dict(spec, eval_fraction=0.1))
    train, evaluation = decoded(config, "train"), decoded(config, "eval")
    assert sorted(train + evaluation) == sorted(TEXTS)
    assert 0 < len(evaluation) < len(TEXTS) // 4


def test_separate_eval_path(tmp_path):
    spec = write_jsonl(tmp_path / "train.jsonl")
    (tmp_path / "eval.jsonl").write_text(json.dumps({"body": "held out"}) + "\n")
    config = config_with(dict(spec, eval_path=str(tmp_path / "eval.jsonl")))
    assert sorted(decoded(config, "train")) == sorted(TEXTS)
    assert decoded(config, "eval") == ["held out"]


@pytest.mark.parametrize("streams", [1, 2, 8])
def test_row_stream_shares_of_a_source_hold_each_document_once(tmp_path, streams):
    config = config_with(write_jsonl(tmp_path / "texts.jsonl"))
    documents = sources.source_documents(source_specs(config)[0], "train",
                                         ByteTokenizer(), config)
    seen = [ByteTokenizer().decode(d)
            for stream in range(streams)
            for d in row_streams.stream_share(documents, stream, streams)]
    assert sorted(seen) == sorted(decoded(config, "train"))


def test_mixture_follows_the_weights(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"a{i}"}) + "\n" for i in range(50)))
    b.write_text("".join(json.dumps({"text": f"b{i}"}) + "\n" for i in range(70)))
    config = config_with(dict(format="jsonl", path=str(a), weight=3),
                         dict(format="jsonl", path=str(b), weight=1))
    mixed = row_streams.mixture(config, "train", 0, ByteTokenizer())
    # Framed pairs: the first input is BOS, the second the source's letter.
    letters = [chr(mixed[i]["inputs"][1] - 3) for i in range(400)]
    share = letters.count("a") / len(letters)
    assert abs(share - 0.75) < 0.05
    # Deterministic for a seed: the same mixture again.
    again = row_streams.mixture(config, "train", 0, ByteTokenizer())
    assert letters == [chr(again[i]["inputs"][1] - 3) for i in range(400)]


def test_batches_from_a_mixture_never_attend_across_documents(tmp_path):
    config = config_with(write_jsonl(tmp_path / "a.jsonl"), write_lines(tmp_path / "b.txt"),
                         packing="first_fit")
    mesh = Mesh(np.array(jax.devices()), ("data",))
    it = make_input(config, "train", NamedSharding(mesh, PartitionSpec("data")))
    batch = jax.device_get(next(it))
    it.close()
    mask = model_attention_mask(batch["segment_ids"])
    segments = batch["segment_ids"]
    b, q, k = np.nonzero(mask)
    assert (segments[b, q] == segments[b, k]).all() and (k <= q).all()
    assert (batch["loss_mask"] == (segments != 0)).all()


def test_a_malformed_record_is_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "texts.jsonl"
    spec = write_jsonl(path)
    lines = path.read_text().splitlines()
    lines[40] = lines[40][:-5]  # truncated JSON
    lines[41] = json.dumps({"id": 41})  # no text field
    path.write_text("\n".join(lines) + "\n")
    config = config_with(dict(spec, eval_fraction=0.01))
    skipped = sources.SkippedRecords()
    documents = sources.source_documents(source_specs(config)[0], "train",
                                         ByteTokenizer(), config, skipped)
    read = [documents[i] for i in range(len(documents))]
    assert sum(d is None for d in read) == 2
    assert skipped.count == 2  # what the trainer logs
    assert "skipped malformed record 2 of at most 100" in caplog.text
    config.data.max_bad_records = 1
    documents = sources.source_documents(source_specs(config)[0], "train",
                                         ByteTokenizer(), config)
    with pytest.raises(JaxscaleError, match="2 malformed records.*max_bad_records=1"):
        [documents[i] for i in range(len(documents))]


def documents_of(config, split="train"):
    return sources.source_documents(source_specs(config)[0], split, ByteTokenizer(),
                                    config)


def test_bad_input_fails_with_one_line(tmp_path):
    missing = config_with(dict(format="jsonl", path=str(tmp_path / "nothing*.jsonl")))
    assert "matches no files" in one_line_error(ConfigError, lambda: documents_of(missing))

    wrong_field = config_with(dict(write_jsonl(tmp_path / "t.jsonl"), text_field="text"))
    assert "no text field 'text'" in one_line_error(JaxscaleError,
                                                    lambda: documents_of(wrong_field))

    write_tokens(tmp_path / "t.bin")
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "t.bin").write_bytes(data[:-3])
    cut_tokens = config_with(dict(format="tokens", path=str(tmp_path / "t.bin")))
    assert "truncated" in one_line_error(JaxscaleError, lambda: documents_of(cut_tokens))

    write_array_record(tmp_path / "t.array_record")
    data = (tmp_path / "t.array_record").read_bytes()
    (tmp_path / "cut.array_record").write_bytes(data[:len(data) // 2])
    cut_records = config_with(dict(format="array_record",
                                   path=str(tmp_path / "cut.array_record")))
    assert "cannot open ArrayRecord" in one_line_error(JaxscaleError,
                                                       lambda: documents_of(cut_records))


def test_bad_parquet_fails_with_one_line(tmp_path):
    write_parquet(tmp_path / "t.parquet")
    wrong_column = config_with(dict(format="parquet", path=str(tmp_path / "t.parquet"),
                                    text_field="body"))
    assert "no column 'body'" in one_line_error(JaxscaleError, lambda: documents_of(wrong_column))
    data = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
    truncated = config_with(dict(format="parquet", path=str(tmp_path / "cut.parquet")))
    assert "cannot read Parquet" in one_line_error(JaxscaleError, lambda: documents_of(truncated))


@pytest.mark.parametrize("change, message", [
    (dict(sources=(dict(format="stdlib", weight=-1),)), "weight=-1 must be > 0"),
    (dict(sources=(dict(format="stdlib", weight=0),)), "weight=0 must be > 0"),
    (dict(sources=(dict(format="stdlib", weight=float("inf")),)),
     "weight=inf must be a finite number > 0"),
    (dict(sources=(dict(format="stdlib", eval_fraction=float("nan")),)),
     "eval_fraction=nan must be a finite number in (0, 1)"),
    (dict(sources=()), "non-empty tuple"),
    (dict(sources=(dict(format="csv", path="x"),)), "format='csv' is unknown"),
    (dict(sources=(dict(format="jsonl"),)), "needs 'path'"),
    (dict(sources=(dict(format="jsonl", path="x", field="t"),)), "unknown key 'field'"),
    (dict(sources=(dict(format="text", path="x", document="page"),)), "document='page'"),
    (dict(tokenizer="/no/such/tokenizer.model"), "no such file"),
    (dict(packing="best"), "packing='best' is unknown"),
    (dict(workers=-2), "workers=-2"),
])
def test_config_mistakes_fail_validation(change, message):
    config = default_config()
    config.data.update(change)
    assert message in one_line_error(ConfigError, lambda: validate(config, 8))


def test_validation_checks_sizes_against_the_model():
    config = default_config()
    config.model.vocab_size = 200
    assert "smaller than the tokenizer's 259" in one_line_error(ConfigError,
                                                                lambda: validate(config, 8))
    config = default_config()
    config.train.seq_len = config.model.max_seq_len + 1
    assert "exceeds model.max_seq_len" in one_line_error(ConfigError, lambda: validate(config, 8))


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    sentencepiece = pytest.importorskip("sentencepiece")
    path = tmp_path_factory.mktemp("spm") / "tiny.model"
    with open(path, "wb") as f:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(TEXTS * 3), model_writer=f, vocab_size=40,
            character_coverage=1.0, minloglevel=2)
    return str(path)


@pytest.fixture(scope="module")
def huggingface_tokenizer(tmp_path_factory):
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=60,
                                             special_tokens=["<pad>", "<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(TEXTS, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def test_sentencepiece_tokenizer(tmp_path, sentencepiece_model):
    config = config_with(write_jsonl(tmp_path / "t.jsonl"), tokenizer=sentencepiece_model)
    tokenizer = tokenizer_from_config(config)
    assert tokenizer.vocab_size == 40 and (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    ids = tokenizer.encode(TEXTS[5])
    assert ids.dtype == np.int32 and 0 <= ids.min() and ids.max() < 40
    assert tokenizer.decode(ids) == TEXTS[5]
    config.model.vocab_size = 40
    validate(config, 8)
    rows = next(iter(row_streams.local_batches(config, "train", range(8),
                                               sources.SkippedRecords())))
    assert rows["inputs"].max() < 40 and (rows["inputs"] == 1).any()


def test_huggingface_tokenizer(tmp_path, huggingface_tokenizer):
    config = config_with(write_jsonl(tmp_path / "t.jsonl"), tokenizer=huggingface_tokenizer)
    assert "has no BOS token; set data.bos_token" in one_line_error(
        ConfigError, lambda: tokenizer_from_config(config))
    config.data.update(bos_token="<s>", eos_token="</s>")
    tokenizer = tokenizer_from_config(config)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (2, 3)
    assert tokenizer.encode("document 3: abc").max() < tokenizer.vocab_size
    # This BPE has no decoder, so its pieces come back joined by spaces.
    assert tokenizer.decode(tokenizer.encode("document 3: abc")) == "document 3 : abc"
    config.data.bos_token = "<nope>"
    assert "not in the tokenizer's vocabulary" in one_line_error(
        ConfigError, lambda: tokenizer_from_config(config))


def test_prepare_writes_token_files_that_train_the_same_documents(tmp_path):
    spec = write_jsonl(tmp_path / "t.jsonl")
    config = config_with(spec)
    prepared = prepare.prepare(config, str(tmp_path / "out"), workers=1)
    assert prepared == [dict(format="tokens", path=str(tmp_path / "out/source0.train.bin"),
                             eval_path=str(tmp_path / "out/source0.eval.bin"), weight=1.0)]
    tokens_config = config_with(*prepared)
    for split in ("train", "eval"):
        assert decoded(tokens_config, split) == decoded(config, split)
    # Token files remember their tokenizer and refuse another.
    with pytest.raises(JaxscaleError, match="tokenized with 'byte'"):
        token_files.TokenFiles([prepared[0]["path"]], ["x"], "sentencepiece:0123")


def test_prepare_command_line_reports_errors_in_one_line(tmp_path):
    config_file = tmp_path / "config.py"
    config_file.write_text(
        "from jaxscale.config import default_config\n"
        "def get_config():\n"
        "    c = default_config()\n"
        f"    c.data.sources = (dict(format='jsonl', path={str(tmp_path / 'none*.jsonl')!r}),)\n"
        "    return c\n")
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.data.prepare", f"--config={config_file}",
         f"--out={tmp_path / 'out'}"], capture_output=True, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: data.sources[0].path=")
    assert len(result.stderr.strip().splitlines()) == 1


def test_reader_threads_give_the_same_batches_and_resume(tmp_path):
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))

    def batches(it, n):
        return [np.asarray(next(it)["inputs"]) for _ in range(n)]

    config = config_with(write_jsonl(tmp_path / "t.jsonl"), workers=0)
    on_prefetch_thread = make_input(config, "train", sharding)
    expected = batches(on_prefetch_thread, 4)
    on_prefetch_thread.close()
    config.data.workers = 3
    with_threads = make_input(config, "train", sharding)
    got = batches(with_threads, 2)
    state = json.loads(json.dumps(with_threads.get_state()))
    with_threads.close()
    config.data.workers = 0
    resumed = make_input(config, "train", sharding)
    resumed.set_state(state)
    got += batches(resumed, 2)
    resumed.close()
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)
