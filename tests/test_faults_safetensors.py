"""Crafted safetensors and index files (issue 23): each damage or trick below ends
`python -m jaxscale.sample --hf=FOLDER` with exit status 2 and one `error:` line naming the file,
the tensor (or the index entry) and the fix, before any weight is read. Each case edits a copy of
a good folder (tests/fixtures/hf_tied, one file; hf_untied, two shards and an index), so the
untouched rest of the folder is one that loads (tests/test_hf.py).

The entry point runs in this process (tests/test_bad_inputs.py's `run_in_process`); two cases also
run it as a real subprocess.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
from typing import Callable, NamedTuple

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxscale import hf
from jaxscale.errors import TRANSIENT_EXIT_CODE, ConfigError, TransientError
from jaxscale.hf import safetensors, weights
from tests.test_bad_inputs import run_cli, run_in_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
ONE_FILE = "model.safetensors"
SHARD_2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
FIX = "re-download"  # every damaged file's message ends with how to get a good one


def read_parts(path: str) -> tuple[dict, bytes]:
    """(the JSON header, the data section) of a safetensors file."""
    with open(path, "rb") as f:
        blob = f.read()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def write_parts(path: str, header: dict | list | bytes, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def edit_header(change: Callable[[dict], dict | list | bytes | None]):
    """An edit of the folder's model.safetensors: `change` edits the header in place, or returns
    what to write as the header instead."""
    def edit(folder: str) -> None:
        path = os.path.join(folder, ONE_FILE)
        header, data = read_parts(path)
        replaced = change(header)
        write_parts(path, header if replaced is None else replaced, data)
    return edit


def set_entry(tensor: str, **fields):
    return edit_header(lambda header: header[tensor].update(fields))


def edit_index(change: Callable[[dict, str], None]):
    """An edit of the folder's index: `change(index, folder)` edits it in place."""
    def edit(folder: str) -> None:
        path = os.path.join(folder, INDEX)
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
        change(index, folder)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(index, f)
    return edit


def truncate(size: int):
    def edit(folder: str) -> None:
        with open(os.path.join(folder, ONE_FILE), "r+b") as f:
            f.truncate(size)
    return edit


def append(extra: bytes):
    def edit(folder: str) -> None:
        with open(os.path.join(folder, ONE_FILE), "ab") as f:
            f.write(extra)
    return edit


def set_length(length: int):
    def edit(folder: str) -> None:
        with open(os.path.join(folder, ONE_FILE), "r+b") as f:
            f.write(struct.pack("<Q", length))
    return edit


def hole_after_the_embedding(folder: str) -> None:
    """64 bytes no tensor claims between the embedding and the next tensor, every later range
    moved past them: each tensor still fits its range, and the file its tensors."""
    path = os.path.join(folder, ONE_FILE)
    header, data = read_parts(path)
    for name, entry in header.items():
        if name != "__metadata__" and entry["data_offsets"][0] >= 19200:
            entry["data_offsets"] = [offset + 64 for offset in entry["data_offsets"]]
    write_parts(path, header, data[:19200] + b"\0" * 64 + data[19200:])


def repeated_name(header: dict) -> bytes:
    """The header with its last tensor given twice (JSON allows it; the format does not)."""
    text = json.dumps(header)
    name = "model.norm.weight"
    return (text[:-1] + f", {json.dumps(name)}: {json.dumps(header[name])}" + "}").encode()


def escape_upwards(index: dict, folder: str) -> None:
    # The file it names exists, one folder up: only the name's own check can refuse it.
    shutil.copy(os.path.join(folder, SHARD_2), os.path.join(folder, os.pardir, SHARD_2))
    index["weight_map"]["lm_head.weight"] = f"../{SHARD_2}"


def absolute_name(index: dict, folder: str) -> None:
    # The very shard the index means, by its absolute path: still a name outside the folder's.
    index["weight_map"]["lm_head.weight"] = os.path.join(os.path.abspath(folder), SHARD_2)


def second_copy(index: dict, folder: str) -> None:
    """A third shard that holds model.norm.weight as well, listed by the index."""
    norm = np.ones(32, ml_dtypes.bfloat16)
    safetensors.write(os.path.join(folder, "extra.safetensors"), ["model.norm.weight"], [(32,)],
                      norm.dtype, lambda _: norm)
    index["weight_map"]["model.norm.weight"] = "extra.safetensors"


def nested_index(folder: str) -> None:
    """An index nested deeper than any JSON parser recurses."""
    with open(os.path.join(folder, INDEX), "wb") as f:
        f.write(b"[" * 100_000 + b"]" * 100_000)


class Case(NamedTuple):
    id: str
    source: str  # the fixture folder the case edits a copy of
    edit: Callable[[str], None]
    names: tuple[str, ...]  # what the error line must contain


NORM, EMBED = "model.norm.weight", "model.embed_tokens.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
# hf_tied's model.safetensors: a 2032-byte header, then 56384 bytes of tensors, the embedding
# first at [0, 19200) and the final norm last at [56320, 56384).
CASES = [
    # The attack issue 23 found: the norm's 64 bytes read from the JSON header, right before the
    # data section.
    Case("negative begin", "hf_tied", set_entry(NORM, data_offsets=[-64, 0]),
         (ONE_FILE, NORM, "[-64, 0]", FIX)),
    Case("end before begin", "hf_tied", set_entry(NORM, data_offsets=[56384, 56320]),
         (ONE_FILE, NORM, "[56384, 56320]", FIX)),
    Case("ranges overlap", "hf_tied",
         set_entry("model.layers.0.input_layernorm.weight", data_offsets=[19136, 19200]),
         (ONE_FILE, "model.layers.0.input_layernorm.weight", EMBED, "overlaps", FIX)),
    Case("a tensor ends past the file", "hf_tied",
         set_entry(NORM, shape=[64], data_offsets=[56320, 56448]),
         (ONE_FILE, NORM, "56448", "56384", FIX)),
    Case("byte count is not dtype x shape", "hf_tied", set_entry(Q0, shape=[32, 31]),
         (ONE_FILE, Q0, "[32, 31]", "1984", "2048", FIX)),
    Case("offsets that are not whole numbers", "hf_tied",
         set_entry(EMBED, data_offsets=[0.0, 19200.0]), (ONE_FILE, EMBED, "[0.0, 19200.0]", FIX)),
    Case("unknown dtype", "hf_tied", set_entry(Q0, dtype="F7"),
         (ONE_FILE, Q0, "'F7'", "BF16", "save the weights in one of those")),
    Case("negative shape dimension", "hf_tied", set_entry(Q0, shape=[32, -32]),
         (ONE_FILE, Q0, "[32, -32]", FIX)),
    Case("a tensor entry that is no object", "hf_tied",
         edit_header(lambda header: header.update({NORM: "ones"})), (ONE_FILE, NORM, FIX)),
    Case("header that is no object", "hf_tied",
         edit_header(lambda header: list(header.values())),
         (ONE_FILE, "JSON array, not an object", FIX)),
    Case("header that is no JSON", "hf_tied", edit_header(lambda header: b"{'a': 1}"),
         (ONE_FILE, "JSON", FIX)),
    Case("a tensor named twice", "hf_tied", edit_header(repeated_name),
         (ONE_FILE, NORM, "twice", FIX)),
    Case("header nested deeper than the parser recurses", "hf_tied",
         edit_header(lambda header: b"[" * 100_000 + b"]" * 100_000), (ONE_FILE, "JSON", FIX)),
    Case("index nested deeper than the parser recurses", "hf_untied", nested_index,
         (INDEX, "JSON", FIX)),
    Case("non-string metadata", "hf_tied",
         edit_header(lambda header: header.update(__metadata__={"format": ["pt"]})),
         (ONE_FILE, "__metadata__", FIX)),
    Case("header length larger than the file", "hf_tied", set_length(58424),
         (ONE_FILE, "header length 58424", "58424 bytes", FIX)),
    Case("shorter than the header length", "hf_tied", truncate(5), (ONE_FILE, "5 bytes", FIX)),
    # Cut inside layer 1's down_proj, which spans [37824, 41920) of the data section.
    Case("truncated file", "hf_tied", truncate(8 + 2032 + 40000),
         (ONE_FILE, "model.layers.1.mlp.down_proj.weight", "41920", "40000", "truncated", FIX)),
    Case("a hole between tensors", "hf_tied", hole_after_the_embedding,
         (ONE_FILE, "[19200, 19264)", "model.layers.0.input_layernorm.weight", "holes", FIX)),
    Case("bytes that belong to no tensor", "hf_tied", append(b"\0" * 64),
         (ONE_FILE, "56448", "56384", FIX)),
    Case("index names a file one folder up", "hf_untied", edit_index(escape_upwards),
         (INDEX, "lm_head.weight", f"../{SHARD_2}", "outside", FIX)),
    Case("index names an absolute path", "hf_untied", edit_index(absolute_name),
         (INDEX, "lm_head.weight", f"/model/{SHARD_2}", "outside", FIX)),
    Case("index that is no object", "hf_untied",
         edit_index(lambda index, folder: index.update(weight_map=[SHARD_2])),
         (INDEX, "weight_map", FIX)),
    Case("a tensor in two shards", "hf_untied", edit_index(second_copy),
         (NORM, "extra.safetensors", SHARD_2, FIX)),
]


def broken_folder(tmp_path, case: Case) -> str:
    folder = tmp_path / "model"
    shutil.copytree(os.path.join(FIXTURES, case.source), folder)
    case.edit(str(folder))
    return str(folder)


def check_one_error_line(status: int, err: str, names: tuple[str, ...]) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), (status, err)
    missing = [name for name in names if name not in lines[0]]
    assert not missing, f"{lines[0]!r} does not name {missing}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_crafted_file_is_one_error_line(case, tmp_path, capfd):
    folder = broken_folder(tmp_path, case)
    capfd.readouterr()  # what earlier tests left
    status, _, err = run_in_process("jaxscale.sample",
                                    [f"--hf={folder}", "--prompt=w1", "--max_new_tokens=1"], capfd)
    check_one_error_line(status, err, case.names)


ON_THE_COMMAND_LINE = [c for c in CASES
                       if c.id in ("negative begin", "index names a file one folder up")]


@pytest.mark.parametrize("case", ON_THE_COMMAND_LINE, ids=[c.id for c in ON_THE_COMMAND_LINE])
def test_the_command_line_prints_the_same_line(case, tmp_path):
    folder = broken_folder(tmp_path, case)
    status, _, err = run_cli("jaxscale.sample",
                             [f"--hf={folder}", "--prompt=w1", "--max_new_tokens=1"], str(tmp_path))
    check_one_error_line(status, err, case.names)


def test_the_table_has_twelve_cases_or_more():
    assert len({c.id for c in CASES}) == len(CASES) >= 12


# -- files the storage does not deliver ---------------------------------------------------------

def failing_open(monkeypatch, module, error: OSError) -> None:
    """`open` in `module` raises `error`: a disk failing (EIO), a file this process may not read,
    a bucket mount answering HTTP 403."""
    def refuse(*args, **kwargs):
        raise error
    monkeypatch.setattr(module, "open", refuse, raising=False)


STORAGE_ERRORS = [  # (error, what the loader raises, the words of its line)
    (OSError(errno.EIO, "Input/output error"), TransientError, "the storage is failing"),
    (TimeoutError("timed out"), TransientError, "the storage is failing"),
    (PermissionError(errno.EACCES, "Permission denied"), ConfigError,
     "grant this process's user (or service account) access"),
    (OSError("Forbidden: gs://bucket/model/x\nno storage.objects.get access"), ConfigError,
     "grant this process's user (or service account) access"),
]


@pytest.mark.parametrize("error, raised, words", STORAGE_ERRORS,
                         ids=lambda x: str(x)[:16] if isinstance(x, OSError) else None)
def test_a_weights_file_or_index_that_cannot_be_read_is_sorted_like_a_checkpoint(
        tmp_path, monkeypatch, error, raised, words):
    """Only the user's to fix is exit 2; a failing disk is 75 (retried), never "fix the file"."""
    folder = broken_folder(tmp_path, Case("good", "hf_untied", lambda folder: None, ()))
    failing_open(monkeypatch, safetensors, error)
    shard = os.path.join(folder, SHARD_2)
    with pytest.raises(raised, match=re.escape(words)) as found:
        safetensors.read_header(shard)
    assert shard in str(found.value) and "\n" not in str(found.value)
    failing_open(monkeypatch, weights, error)
    with pytest.raises(raised, match=re.escape(words)) as found:
        weights.read_weight_map(os.path.join(folder, INDEX))
    assert INDEX in str(found.value)


@pytest.mark.parametrize("error, raised, words", STORAGE_ERRORS,
                         ids=lambda x: str(x)[:16] if isinstance(x, OSError) else None)
def test_a_folder_whose_files_cannot_be_looked_up_is_not_a_folder_without_them(
        tmp_path, monkeypatch, error, raised, words):
    """Looking for the index (or the single file) on a failing disk: the storage's error, not
    "the folder has neither file" (exit 2, which would ask the user to fix a sound folder)."""
    folder = broken_folder(tmp_path, Case("good", "hf_untied", lambda folder: None, ()))
    real_stat = os.stat

    def failing_stat(path, *args, **kwargs):
        if str(path).startswith(str(folder)):
            raise error
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(weights.os, "stat", failing_stat)
    with pytest.raises(raised, match=re.escape(words)) as found:
        weights.tensor_index(folder)
    assert INDEX in str(found.value) and "neither" not in str(found.value)


def test_a_missing_weights_file_is_exit_2_naming_it(tmp_path):
    missing = str(tmp_path / ONE_FILE)
    with pytest.raises(ConfigError, match=rf"{re.escape(missing)} cannot be read \(No such file"):
        safetensors.read_header(missing)


def test_a_failing_disk_under_the_weights_exits_75_in_one_line(tmp_path, capfd, monkeypatch):
    folder = broken_folder(tmp_path, Case("good", "hf_tied", lambda folder: None, ()))
    failing_open(monkeypatch, safetensors, OSError(errno.EIO, "Input/output error"))
    capfd.readouterr()
    status, _, err = run_in_process("jaxscale.sample",
                                    [f"--hf={folder}", "--prompt=w1", "--max_new_tokens=1"], capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == TRANSIENT_EXIT_CODE and len(lines) == 1, (status, err)
    assert lines[0].startswith("error: ") and ONE_FILE in lines[0], lines


# -- what must still load ----------------------------------------------------------------------

def test_empty_and_scalar_tensors_read_where_the_format_puts_them(tmp_path):
    """An empty tensor takes no bytes (its range may start where the next one does) and a scalar
    takes one element: the checks refuse neither, and each offset is 8 + header + begin."""
    path = str(tmp_path / "t.safetensors")
    c = np.arange(6, dtype="<f4").reshape(2, 3)
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]},
              "b": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]},
              "c": {"dtype": "F32", "shape": [2, 3], "data_offsets": [4, 28]}}
    write_parts(path, header, np.float32(7.0).tobytes() + c.tobytes())
    start = 8 + len(json.dumps(header).encode())
    infos = safetensors.read_header(path)
    assert {n: (i.shape, i.offset) for n, i in infos.items()} == {
        "a": ((0, 4), start), "b": ((), start), "c": ((2, 3), start + 4)}
    np.testing.assert_array_equal(safetensors.read_slice(infos["c"], (2, 3), (slice(1, 2),)),
                                  c[1:2])


def test_a_hugging_face_cache_snapshot_of_symlinks_loads(tmp_path):
    """The Hub's cache links each file of a snapshot to a blob outside its folder: the index's
    names stay inside the folder, so it loads (only the names are checked, not link targets)."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    shutil.copytree(os.path.join(FIXTURES, "hf_untied"), blobs)
    snapshot.mkdir(parents=True)
    for name in os.listdir(blobs):
        os.symlink(os.path.relpath(blobs / name, snapshot), snapshot / name)
    linked, _ = hf.load_model(str(snapshot))
    direct, _ = hf.load_model(str(blobs))
    jax.tree.map(np.testing.assert_array_equal, nnx.state(linked, nnx.Param),
                 nnx.state(direct, nnx.Param))
