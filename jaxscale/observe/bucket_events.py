"""TensorBoard event files written into a bucket (gs://, s3://) through fsspec, the library every
other bucket path of jaxscale goes through: tensorboardX's own bucket writers need boto3 or
google-cloud-storage, which the `cloud` extra does not install, and raise errors that
runtime/storage.py does not classify."""

from __future__ import annotations

import io
import threading

from tensorboardX import record_writer

from jaxscale.runtime.storage import classified, filesystem

_FIX = "set metrics.tensorboard_dir to a bucket folder this account can write"


class _EventObject:
    """One event file in a bucket: the bytes so far, the whole object written again at each
    flush (an object cannot be appended to), so that TensorBoard shows the run as it goes.
    tensorboardX's writer thread and the training loop both flush: one at a time."""

    def __init__(self, url: str):
        self._url = url
        self._fs, self._path = filesystem(url, "metrics.tensorboard_dir")
        self._buffer = io.BytesIO()
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            self._buffer.write(data)

    def flush(self) -> None:
        with self._lock:
            with classified(f"cannot write {self._url!r}", _FIX):
                self._fs.pipe_file(self._path, self._buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _BucketFactory:
    """What tensorboardX opens a URL's event file with (its `register_writer_factory`)."""

    def open(self, url: str) -> _EventObject:
        return _EventObject(url)

    def directory_check(self, url: str) -> None:
        """Nothing: a bucket has no folders to make (the bucket is checked at start)."""


def register_bucket_writers() -> None:
    """tensorboardX writes gs:// and s3:// event files through fsspec from now on."""
    for scheme in ("gs", "s3"):
        record_writer.register_writer_factory(scheme, _BucketFactory())
