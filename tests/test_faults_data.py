"""Faults while reading data, per source format (issue 45, item 1): a read that fails is never a
malformed record. The storage failing (EIO, ENOSPC) stops the run with a TransientError (exit 75)
whose one line names the file, having skipped no document, so the restart from the last
checkpoint's data position trains on every one; the storage refusing (EACCES) is the user's
(exit 2), and at start-up neither writes anything.

Faults are injected where each reader meets the operating system: `open` and `os.open` (text
files, the line scan, token metadata), `os.pread` (lines, JSONL, chat, token files), pyarrow's
`ParquetFile` and grain's `ArrayRecordDataSource` (their reads are C++: they raise what pyarrow
and array_record raised when a failing `pread` was injected under them with an LD_PRELOAD shim,
recorded in /work/notes/45.md)."""

import builtins
import errno
import json
import os

import grain
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.data import make_input, sources
from jaxscale.errors import ConfigError, TransientError
from tests.helpers import TEXTS, config_with
from tests.test_data_sources import FIXTURES

FORMATS = [*FIXTURES, "chat"]


def write_chat(path):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"question {i}"},
        {"role": "assistant", "content": text}]}) + "\n" for i, text in enumerate(TEXTS)))
    return dict(format="chat", path=str(path))


def data_config(tmp_path, name):
    """(a config reading format `name` from files in <tmp_path>/data, that folder)."""
    folder = tmp_path / "data"
    folder.mkdir()
    if name == "chat":
        spec = write_chat(folder / "chat.jsonl")
    else:
        writer, file_name = FIXTURES[name]
        spec = writer(folder / file_name)
    config = config_with(dict(spec, eval_fraction=0.1),
                         packing="first_fit" if name == "chat" else "concat")
    config.train.seq_len = 128  # every conversation fits a row
    return config, str(folder)


class Faults:
    """While `on`, every read of a file under `folder` fails with OSError(`number`) as the
    format's reader would see it; `failed` counts the failed reads."""

    def __init__(self, monkeypatch, name: str, folder: str, number: int):
        self.folder, self.number, self.on, self.failed = folder, number, False, 0
        self._patch(monkeypatch, name)

    def hits(self, path) -> bool:
        if self.on and str(path).startswith(self.folder):
            self.failed += 1
            return True
        return False

    def error(self, path=None) -> OSError:
        return OSError(self.number, os.strerror(self.number), *([str(path)] if path else []))

    def _patch(self, monkeypatch, name):
        real_open, real_os_open, real_pread = builtins.open, os.open, os.pread

        def opening(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and self.hits(path):
                raise self.error(path)
            return real_open(path, *args, **kwargs)

        def os_opening(path, *args, **kwargs):
            if self.hits(path):
                raise self.error(path)
            return real_os_open(path, *args, **kwargs)

        def preading(fd, size, offset):
            if self.hits(os.readlink(f"/proc/self/fd/{fd}")):
                raise self.error()  # pread's errors name no file
            return real_pread(fd, size, offset)

        monkeypatch.setattr(builtins, "open", opening)
        monkeypatch.setattr(os, "open", os_opening)
        monkeypatch.setattr(os, "pread", preading)
        if name == "parquet":
            import pyarrow.parquet as pq

            real_init, real_read = pq.ParquetFile.__init__, pq.ParquetFile.read_row_group
            words = f"[errno {self.number}] {os.strerror(self.number)}"

            def parquet_init(file, source, *args, **kwargs):
                if self.hits(source):
                    raise OSError(self.number, f"Failed to open local file '{source}'. Detail: "
                                               f"{words}")
                real_init(file, source, *args, **kwargs)
                file.jaxscale_test_path = str(source)

            def parquet_read(file, *args, **kwargs):
                if self.hits(getattr(file, "jaxscale_test_path", "")):
                    raise OSError(self.number, f"Error reading bytes from file. Detail: {words}")
                return real_read(file, *args, **kwargs)
            monkeypatch.setattr(pq.ParquetFile, "__init__", parquet_init)
            monkeypatch.setattr(pq.ParquetFile, "read_row_group", parquet_read)
        if name == "array_record":
            source_class = grain.sources.ArrayRecordDataSource
            real_init, real_get = source_class.__init__, source_class.__getitem__

            def array_record_init(source, paths, *args, **kwargs):
                if self.hits(paths[0]):
                    raise RuntimeError(f"open() failed: {os.strerror(self.number)}; opening "
                                       f"{paths[0]}")
                real_init(source, paths, *args, **kwargs)
                source.jaxscale_test_path = str(paths[0])

            def array_record_get(source, record):
                path = getattr(source, "jaxscale_test_path", "")
                if self.hits(path):
                    raise RuntimeError(f"pread() failed: {os.strerror(self.number)}; reading "
                                       f"{path}; at byte 617; Could not read from the underlying "
                                       "reader; at byte 0")
                return real_get(source, record)
            monkeypatch.setattr(source_class, "__init__", array_record_init)
            monkeypatch.setattr(source_class, "__getitem__", array_record_get)


@pytest.fixture(scope="module")
def sharding():
    return NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))


def take(it, n):
    return [np.asarray(next(it)["inputs"]) for _ in range(n)]


@pytest.mark.parametrize("number", [errno.EIO, errno.ENOSPC], ids=["EIO", "ENOSPC"])
@pytest.mark.parametrize("name", FORMATS)
def test_a_failing_read_mid_run_is_transient_names_the_file_and_skips_no_document(
        tmp_path, monkeypatch, sharding, name, number, caplog):
    config, folder = data_config(tmp_path, name)
    uninterrupted = make_input(config, "train", sharding)
    expected = take(uninterrupted, 4)
    uninterrupted.close()

    faults = Faults(monkeypatch, name, folder, number)
    it = make_input(config, "train", sharding)
    got = take(it, 2)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint keeps it
    faults.on = True
    with pytest.raises(TransientError) as raised:
        take(it, 100)  # the prefetched batches first, then a read that fails
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"cannot read '{folder}/")
    assert message.endswith(": the storage is failing"), message
    assert it.skipped_records() == 0 and "malformed" not in caplog.text
    it.close()

    faults.on = False  # the storage is back: the restart resumes at the checkpoint's position
    resumed = make_input(config, "train", sharding)
    resumed.set_state(state)
    got += take(resumed, 2)
    resumed.close()
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("number, raised", [(errno.EACCES, ConfigError),
                                            (errno.EIO, TransientError)], ids=["EACCES", "EIO"])
@pytest.mark.parametrize("name", FORMATS)
def test_a_source_that_cannot_be_read_at_start_is_one_line_of_its_kind(
        tmp_path, monkeypatch, name, number, raised):
    """Checked before anything is written (the trainer's first checks): refused is the user's
    (exit 2, with the fix), a failing storage transient (exit 75)."""
    config, folder = data_config(tmp_path, name)
    faults = Faults(monkeypatch, name, folder, number)
    faults.on = True
    with pytest.raises(raised) as error:
        sources.check_splits(config, ("train",))
    message = str(error.value)
    assert faults.failed and "\n" not in message
    assert message.startswith(f"cannot read '{folder}/") or f"'{folder}/" in message, message
    if raised is ConfigError:
        assert "access was denied: grant this process's user" in message
