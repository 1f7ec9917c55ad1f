"""The embedded chat data set (jaxscale.data.stdlib_chat) and configs/tiny_chat.py: the same seed
writes the same bytes; jaxscale's own chat reader takes every conversation, whole in a row, and
learns only the replies; bad flags are one error line; the config trains on it."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from jaxscale.cli import load_config_file
from jaxscale.data import chat, sources, stdlib_chat
from jaxscale.data.specs import source_specs
from jaxscale.data.tokenizers import ByteTokenizer
from jaxscale.inference.samples import check_samples
from jaxscale.trainer import Trainer
from tests.helpers import REPO

BYTE = ByteTokenizer()
END = "<|end|>\n"  # how the built-in template closes a turn


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Every pair, seed 0, written by the command line."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    result = subprocess.run([sys.executable, "-m", "jaxscale.data.stdlib_chat", f"--out={path}"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("wrote ") and f"(seed 0) to {path}" in result.stdout
    return path


def test_the_same_seed_writes_the_same_bytes(data_file, tmp_path):
    again = tmp_path / "again.jsonl"
    stdlib_chat.write(str(again), seed=0, count=0)
    assert again.read_bytes() == data_file.read_bytes()
    lines = data_file.read_text().splitlines()
    assert 2000 < len(lines) == len(set(lines))  # a few thousand, no two alike
    other = [json.dumps(r, ensure_ascii=False) for r in stdlib_chat.conversations(seed=1)]
    assert sorted(other) == sorted(lines) and other != lines  # the same pairs, another order
    assert [json.dumps(r, ensure_ascii=False) for r in stdlib_chat.conversations(0, 10)] \
        == lines[:10]


def test_the_answers_are_the_librarys_own(data_file):
    import json as json_module
    import shutil

    answers = {}
    for line in data_file.read_text().splitlines():
        question, answer = (m["content"] for m in json.loads(line)["messages"])
        answers[question] = answer
    assert answers["What does json.dumps do?"] == \
        " ".join(json_module.dumps.__doc__.split("\n\n")[0].split())
    assert answers["How do I call shutil.copyfile?"] == \
        "shutil.copyfile(src, dst, *, follow_symlinks=True)"
    assert shutil.copyfile.__code__.co_varnames[:2] == ("src", "dst")
    assert answers["How do I call queue.Queue?"] == "queue.Queue(maxsize=0)"  # less `self`
    assert not any(q.split()[-2 if q.startswith("What") else -1].startswith(("_", "test."))
                   for q in answers)


def test_chat_reader_takes_every_conversation_and_learns_only_the_replies(data_file):
    config = load_config_file(f"{REPO}/configs/tiny_chat.py:{data_file}")
    spec = source_specs(config)[0]
    skipped = sources.SkippedRecords()
    read = 0
    records = [json.loads(line) for line in data_file.read_text().splitlines()]
    for split in ("train", "eval"):
        documents = sources.source_documents(spec, split, BYTE, config, skipped)
        for i in range(len(documents)):
            document = documents[i]
            tokens, learned = document.tokens, document.learned
            assert len(tokens) <= config.train.seq_len + 1  # whole in a row of configs/tiny_chat
            text = BYTE.decode(tokens[1:-1])  # BOS ... EOS around the rendered conversation
            question, answer = text.split(END)[:2]
            assert tokens[-1] == BYTE.eos_id and learned[-1]  # it learns to stop after a reply
            np.testing.assert_array_equal(learned[:-1], [False] * (1 + len(question + END) + len(
                "<|assistant|>\n")) + [True] * len(answer.removeprefix("<|assistant|>\n") + END))
            read += 1
    assert skipped.count == 0 and read == len(records)


def test_the_sample_prompts_are_the_templates_questions(data_file):
    config = load_config_file(f"{REPO}/configs/tiny_chat.py:{data_file}")
    encode = chat.ChatEncoder(source_specs(config)[0], BYTE, config)
    questions = [encode.render([{"role": "user", "content": q}], add_generation_prompt=True)
                 for q in ("How do I call json.dumps?", "What does shutil.copyfile do?")]
    assert list(config.train.sample_prompts) == questions
    check_samples(config)  # they and their answers fit the model


@pytest.mark.parametrize("args, message", [
    (["--pairs=-1"], "argument --pairs: -1 must be >= 0 (0: all)"),
    (["--pairs=1000000"], "--pairs=1000000: this Python's standard library gives"),
    (["--out={tmp}"], "is a folder; give a file name"),
    (["--out={tmp}/file/chat.jsonl"], "cannot be written"),
    ([], "the following arguments are required: --out"),
])
def test_bad_flags_are_one_error_line_and_exit_2(args, message, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    if not any(a.startswith("--out") for a in args) and args:
        args = [*args, f"--out={tmp_path}/chat.jsonl"]
    with pytest.raises(SystemExit) as exited:
        stdlib_chat.main([a.format(tmp=tmp_path) for a in args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "chat.jsonl").exists()


@pytest.mark.slow  # a training run end to end: CI runs it with the slow ones
def test_tiny_chat_trains_on_it(data_file, tmp_path):
    config = load_config_file(f"{REPO}/configs/tiny_chat.py:{data_file}")
    # From scratch (no runs/default here), 20 steps, no samples (compiling the sampler would
    # double the time; test_the_sample_prompts_are_the_templates_questions checks them).
    config.checkpoint.update(restore_from="", restore_params_only=False, enabled=False,
                             compilation_cache=False)
    config.train.update(steps=20, batch_size=8, log_every=5, eval_every=0, sample_every=0)
    metrics = Trainer(config, str(tmp_path / "run")).run()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    assert metrics["data_skipped_records"] == 0
