"""Bad data and tokenizer inputs (issue 8): each fails at start, in one line naming what is wrong,
the bad value and the fix — or, for data that is only suspicious, warns."""

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from ml_collections import config_flags

from jaxscale.checks import validate
from jaxscale.cli import DEFAULT_CONFIG
from jaxscale.data import check_splits, formats, prepare, sources, token_files
from jaxscale.data.specs import source_specs
from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
from jaxscale.errors import ConfigError, JaxscaleError
from tests.helpers import TEXTS, config_with, one_line_error


def documents_of(config, split="train"):
    return sources.source_documents(source_specs(config)[0], split, ByteTokenizer(),
                                    config)


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return dict(format="jsonl", path=str(path))


GOOD_LINES = [json.dumps({"text": t}) for t in TEXTS]


# --- tokenizers --------------------------------------------------------------------------------

@pytest.mark.parametrize("content, reason", [
    (b"not json {", "is not JSON"),
    (b"\x89PNG\r\n\x1a\n\x00\x00binary", "is not JSON"),
    (b'{"version": "1.0"}', "cannot be loaded as a Hugging Face tokenizer"),
    (b"[1, 2, 3]", "is a JSON array, not an object"),
], ids=["invalid_json", "binary", "json_object_rejected", "json_list_rejected"])
def test_a_garbage_tokenizer_json_is_a_config_error_naming_the_file(tmp_path, content, reason):
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    config = config_with(dict(format="synthetic"), tokenizer=str(path))
    message = one_line_error(ConfigError, lambda: tokenizer_from_config(config))
    assert message.startswith(f"data.tokenizer={str(path)!r} ")
    assert reason in message and "Tokenizer.save" in message
    # validate, which every entry point runs first, reports it the same way.
    assert reason in one_line_error(ConfigError, lambda: validate(config, 8))


def test_a_garbage_sentencepiece_model_is_a_config_error_naming_the_file(tmp_path):
    pytest.importorskip("sentencepiece")
    path = tmp_path / "tiny.model"
    path.write_bytes(b"garbage\x00\x01")
    config = config_with(dict(format="synthetic"), tokenizer=str(path))
    message = one_line_error(ConfigError, lambda: tokenizer_from_config(config))
    assert message.startswith(f"data.tokenizer={str(path)!r} cannot be loaded as a "
                              "SentencePiece model")


# --- JSONL: malformed JSON is not a missing field ----------------------------------------------

def test_a_malformed_first_jsonl_line_is_skipped_as_a_bad_record(tmp_path, caplog):
    spec = write_jsonl(tmp_path / "t.jsonl", ['{"text": "cut sho'] + GOOD_LINES)
    config = config_with(dict(spec, eval_fraction=0.01))
    skipped = sources.SkippedRecords()
    documents = sources.source_documents(source_specs(config)[0], "train",
                                         ByteTokenizer(), config, skipped)  # one bad line: opens
    read = [documents[i] for i in range(len(documents))]
    assert sum(d is None for d in read) == 1
    assert skipped.count == 1  # data_skipped_records
    assert "t.jsonl line 1 is not JSON" in caplog.text
    assert "text_field" not in caplog.text


def test_a_jsonl_file_of_malformed_lines_is_not_a_text_field_error(tmp_path):
    spec = write_jsonl(tmp_path / "t.jsonl", ["this is plain text", "and so is this"] * 30)
    message = one_line_error(JaxscaleError, lambda: documents_of(config_with(spec)))
    assert "t.jsonl line 1 is not JSON" in message
    assert "nor is any of the first 32 lines" in message
    assert "text_field" not in message
    assert "format='text'" in message


def test_jsonl_lines_that_are_not_objects_say_so(tmp_path):
    spec = write_jsonl(tmp_path / "t.jsonl", ['["a", "list"]'] * 3)
    message = one_line_error(JaxscaleError, lambda: documents_of(config_with(spec)))
    assert "t.jsonl line 1 is a JSON array, not an object" in message
    assert "text_field" not in message


def test_a_missing_text_field_still_names_text_field_and_the_line(tmp_path):
    # The first line is broken JSON; the first JSON object lacks the field: the field is wrong.
    spec = write_jsonl(tmp_path / "t.jsonl", ['{"body": ', '{"body": "x"}', '{"body": "y"}'])
    message = one_line_error(JaxscaleError, lambda: documents_of(config_with(spec)))
    assert "t.jsonl line 2 has no text field 'text' (has ['body'])" in message
    assert "set data.sources[0].text_field" in message


def test_malformed_lines_are_named_by_their_line_in_the_file(tmp_path):
    # Empty lines are not documents, but they count when a message names a line.
    lines = GOOD_LINES[:10] + ["", "", '{"text": 5}'] + GOOD_LINES[10:]
    spec = write_jsonl(tmp_path / "t.jsonl", lines)
    reader = formats.JsonLines([spec["path"]], ["t"], "text")
    assert len(reader) == len(GOOD_LINES) + 1
    with pytest.raises(formats.MalformedRecord, match=r"t\.jsonl line 13: field 'text' is int"):
        reader[10]


# --- prepare --out -----------------------------------------------------------------------------

def test_prepare_refuses_an_out_that_is_a_file(tmp_path):
    spec = write_jsonl(tmp_path / "t.jsonl", GOOD_LINES)
    out = tmp_path / "out.txt"
    out.write_text("keep me")
    message = one_line_error(JaxscaleError,
                             lambda: prepare.prepare(config_with(spec), str(out), workers=1))
    assert message.startswith(f"--out={str(out)!r} is a file, not a folder; give a folder")
    assert out.read_text() == "keep me"


def test_prepare_command_line_with_an_out_file_gives_one_error_line(tmp_path):
    out = tmp_path / "out.txt"
    out.write_text("keep me")
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.data.prepare", "--config.data.sources="
         "(dict(format='synthetic'),)", f"--out={out}"], capture_output=True, text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"error: --out={str(out)!r} is a file, not a folder; give a "
                                      "folder for the token files (it is created if missing)")


def test_prepare_overwrites_its_own_files_and_refuses_another_configs(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", GOOD_LINES)
    b = write_jsonl(tmp_path / "b.jsonl", GOOD_LINES[::-1])
    out = tmp_path / "out"
    first = prepare.prepare(config_with(a), str(out), workers=1)
    # Again with the same sources (another weight only mixes them): overwrites, and says so.
    assert prepare.prepare(config_with(dict(a, weight=2)), str(out), workers=1)[0]["path"] \
        == first[0]["path"]
    assert "overwriting the token files" in capsys.readouterr().err
    listing = sorted(os.listdir(out))
    before = {name: (out / name).read_bytes() for name in listing}
    message = one_line_error(JaxscaleError,
                             lambda: prepare.prepare(config_with(b), str(out), workers=1))
    assert message.startswith(f"--out={str(out)!r} already holds token files of another config "
                              "(data.sources[0] was ")
    assert "give a new folder, or delete its prepare.json and source* files" in message
    # Refused before anything was written.
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before


def test_prepare_refuses_token_files_it_cannot_trace(tmp_path):
    spec = write_jsonl(tmp_path / "a.jsonl", GOOD_LINES)
    out = tmp_path / "out"
    out.mkdir()
    token_files.write_token_file(str(out / "source0.train"), [np.arange(3, 9)], 259, "byte")
    message = one_line_error(JaxscaleError,
                             lambda: prepare.prepare(config_with(spec), str(out), workers=1))
    assert "already holds token files (source0.train.bin, ...) but no prepare.json" in message


def test_prepare_checks_every_split_before_writing(tmp_path):
    spec = write_jsonl(tmp_path / "a.jsonl", GOOD_LINES[:3])
    out = tmp_path / "out"
    message = one_line_error(JaxscaleError,
                             lambda: prepare.prepare(config_with(spec), str(out), workers=1))
    assert "has no eval documents" in message and "eval_every" not in message
    assert not out.exists()


# --- data.sources on the command line ----------------------------------------------------------

def parse_override(*overrides):
    """The config as `python -m jaxscale.train` gets it: its config flag, then --config.KEY=..."""
    flag_values = flags.FlagValues()
    argv = ["prog", *overrides]
    flag = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "config file",
                                           flag_values=flag_values, lock_config=True,
                                           sys_argv=argv)
    flag_values(argv)
    return flag.value


DOCS_FORMS = [
    ("(dict(format='synthetic'),)", [dict(format="synthetic")]),
    ("(dict(format='jsonl', path='x.jsonl'),)", [dict(format="jsonl", path="x.jsonl")]),
    ("(dict(format='stdlib', weight=1), dict(format='synthetic', weight=3))",
     [dict(format="stdlib", weight=1), dict(format="synthetic", weight=3)]),
    ("[dict(format='jsonl', path='x.jsonl', text_field='body', eval_fraction=0.1)]",
     [dict(format="jsonl", path="x.jsonl", text_field="body", eval_fraction=0.1)]),
    ("dict(format='synthetic')", [dict(format="synthetic")]),
    ("({'format': 'text', 'path': 'd/*.txt', 'document': 'line'},)",
     [dict(format="text", path="d/*.txt", document="line")]),
]


@pytest.mark.parametrize("text, expected", DOCS_FORMS)
def test_sources_given_on_the_command_line_as_in_the_docs(text, expected):
    config = parse_override(f"--config.data.sources={text}")
    specs = source_specs(config)
    assert [{k: spec[k] for k in entry} for spec, entry in zip(specs, expected,
                                                                 strict=True)] == expected
    assert [spec["name"] for spec in specs] == [f"data.sources[{i}]"
                                                for i in range(len(expected))]


def test_the_command_line_example_of_the_docs_trains(tmp_path):
    docs = open(os.path.join(os.path.dirname(DEFAULT_CONFIG), "..", "docs", "data.md")).read()
    example = docs.split("On the command line: `")[1].split("`")[0]
    assert example.startswith("--config.data.sources=")
    config = parse_override(example.replace('"', ""))
    validate(config, 8)
    check_splits(config)


@pytest.mark.parametrize("text, message", [
    ("(dict(format=synthetic),)", "synthetic is a name, not a value (quote strings: "
                                  "'synthetic')"),
    ("(__import__('os').system('touch x'),)", "is not a literal or dict(key=value, ...)"),
    ("(dict(format='synthetic', **{'a': 1}),)", "is not a literal or dict(key=value, ...)"),
    ("dict(format='synthetic'", "is not a Python expression"),
    ("{'format': 'synthetic'}", "data.sources[0]='format' cannot be read"),
])
def test_sources_text_is_read_safely_and_errors_name_it(text, message):
    config = parse_override(f"--config.data.sources={text}")
    error = one_line_error(ConfigError, lambda: source_specs(config))
    assert message in error
    assert "e.g. --config.data.sources=\"(dict(format='jsonl', path='data/*.jsonl'),)\"" in error


def test_parsed_sources_are_still_checked():
    config = parse_override("--config.data.sources=(dict(format='stdlib', weight=-1),)")
    assert "data.sources[0].weight=-1 must be > 0" in one_line_error(
        ConfigError, lambda: validate(config, 8))


# --- empty and binary sources ------------------------------------------------------------------

def test_an_empty_text_file_fails_when_the_source_opens(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    config = config_with(dict(format="text", path=str(tmp_path / "empty.txt")))
    message = one_line_error(JaxscaleError, lambda: documents_of(config))
    assert message.startswith("data.sources[0] (text ")
    assert message.endswith("has nothing to read: its 1 train document is empty; put text in its "
                            "files or fix the path")
    assert "document is empty" in one_line_error(JaxscaleError,
                                                 lambda: check_splits(config, ("train",)))


@pytest.mark.parametrize("case", ["files", "lines", "jsonl", "tokens"])
def test_a_train_split_with_no_tokens_fails_at_start(tmp_path, case):
    if case == "files":
        for i in range(5):
            (tmp_path / f"{i}.txt").write_text("")
        spec = dict(format="text", path=str(tmp_path / "*.txt"), eval_fraction=0.01)
    elif case == "lines":
        (tmp_path / "t.txt").write_text("\n\n\n")
        spec = dict(format="text", path=str(tmp_path / "t.txt"), document="line")
    elif case == "jsonl":
        spec = write_jsonl(tmp_path / "t.jsonl", ['{"text": ""}'] * 5)
        spec["eval_fraction"] = 0.01
    else:
        token_files.write_token_file(str(tmp_path / "t"), [np.zeros(0, np.int32)] * 5, 259,
                                     "byte")
        spec = dict(format="tokens", path=str(tmp_path / "t.bin"), eval_fraction=0.01)
    config = config_with(spec)
    message = one_line_error(JaxscaleError, lambda: check_splits(config, ("train",)))
    assert message.startswith("data.sources[0] (")
    assert "holds no documents" in message or "empty" in message


def test_a_binary_file_read_as_text_warns_once_naming_it(tmp_path, caplog):
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(10):
        (data / f"{i}.txt").write_bytes(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    config = config_with(dict(format="text", path=str(data / "*.txt"), eval_fraction=0.01))
    with caplog.at_level(logging.WARNING):
        documents_of(config)
        documents_of(config)
    warnings = [r.getMessage() for r in caplog.records if "not UTF-8 text" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"data.sources[0] (text {str(data / '*.txt')!r}): ")
    assert str(data / "0.txt") in warnings[0] or "more files" in warnings[0]
    assert "binary file" in warnings[0]


def test_text_sources_of_utf8_text_do_not_warn(tmp_path, caplog):
    data = tmp_path / "data"
    data.mkdir()
    for i, text in enumerate(TEXTS):
        (data / f"{i}.txt").write_text(text + " — ünïcödé ✓")
    (data / "one.bin").write_bytes(bytes(range(256)))  # one odd file among many is no alarm
    config = config_with(dict(format="text", path=str(data / "*")))
    with caplog.at_level(logging.WARNING):
        documents_of(config)
        documents_of(config, "eval")
    assert "not UTF-8" not in caplog.text


# --- check_splits: eval problems at start ------------------------------------------------------

def test_check_splits_finds_a_source_without_eval_documents(tmp_path):
    spec = write_jsonl(tmp_path / "small.jsonl", GOOD_LINES[:5])
    config = config_with(spec)
    check_splits(config, ("train",))  # a run without eval is fine
    message = one_line_error(JaxscaleError, lambda: check_splits(config))
    assert message == (
        f"data.sources[0] (jsonl {spec['path']!r}) has no eval documents: eval_fraction=0.02 of "
        "its 5 documents holds out none; raise its eval_fraction, give it an eval_path, or set "
        "train.eval_every=0 to train without eval")
    # The pipeline fails the same way (at the first eval, without check_splits).
    assert "has no eval documents" in one_line_error(JaxscaleError,
                                                     lambda: documents_of(config, "eval"))
    config.data.sources = (dict(spec, eval_fraction=0.5),)
    check_splits(config)


def test_check_splits_finds_an_eval_path_without_documents(tmp_path):
    spec = write_jsonl(tmp_path / "train.jsonl", GOOD_LINES)
    (tmp_path / "eval.jsonl").write_text("\n")
    config = config_with(spec, dict(spec, eval_path=str(tmp_path / "eval.jsonl")))
    message = one_line_error(JaxscaleError, lambda: check_splits(config))
    assert message.startswith(f"data.sources[1].eval_path={str(tmp_path / 'eval.jsonl')!r} "
                              "holds no documents; ")
    assert "train.eval_every=0" in message


def test_check_splits_finds_a_train_split_held_out_entirely(tmp_path):
    spec = write_jsonl(tmp_path / "one.jsonl", GOOD_LINES[:1])
    config = config_with(dict(spec, eval_fraction=0.999999))
    message = one_line_error(JaxscaleError, lambda: check_splits(config, ("train",)))
    assert "has no train documents: eval_fraction=0.999999 holds out all of its 1" in message


def test_check_splits_reports_missing_files_and_bad_specs(tmp_path):
    config = config_with(dict(format="jsonl", path=str(tmp_path / "none*.jsonl")))
    assert "matches no files" in one_line_error(ConfigError, lambda: check_splits(config))
    config = config_with(dict(format="jsonl", path="x", eval_fraction=2))
    assert "eval_fraction=2 must be in (0, 1)" in one_line_error(
        ConfigError, lambda: check_splits(config))


@pytest.mark.parametrize("source", ["stdlib", "synthetic"])
def test_check_splits_reads_no_document_of_the_default_sources(monkeypatch, source):
    def no_reading(*args, **kwargs):
        raise AssertionError("check_splits read a document")

    for reader in (formats.RecordReader, formats.WholeFiles):
        monkeypatch.setattr(reader, "read", no_reading)
        monkeypatch.setattr(reader, "sample", no_reading)
    monkeypatch.setattr(ByteTokenizer, "encode", no_reading)
    check_splits(config_with(dict(format=source)))
