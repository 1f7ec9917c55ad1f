"""Data and checkpoints in buckets (gs://, s3://), against real storage servers on loopback ports
(tests/storage_servers.py), and what a bucket path does without the `cloud` extra."""

import json
import logging
import os
import re
import subprocess
import sys

import fsspec
import jax
import numpy as np
import pytest
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxscale.checkpoint import Checkpoints
from jaxscale.data import make_input, prepare, sources
from jaxscale.data.row_streams import reads_a_bucket
from jaxscale.data.sources import source_specs
from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
from jaxscale.errors import ConfigError, JaxscaleError, TransientError
from jaxscale.export_hf import export
from jaxscale.runtime.storage import filesystem
from jaxscale.trainer import Trainer
from tests.fault_proxy import FaultProxy
from tests.helpers import (
    REPO,
    config_with,
    one_line_error,
    resumable_cli_losses,
    resumable_cli_run,
    small_config,
)
from tests.storage_servers import (  # noqa: F401 (fixtures)
    free_port,
    gcs,
    gcs_variables,
    s3,
    s3_server_refusing_credentials,
    s3_variables,
)
from tests.test_data import assert_same, take
from tests.test_data_sources import (  # noqa: F401 (fixtures)
    decoded,
    huggingface_tokenizer,
    sentencepiece_model,
    write_fixture,
)


def test_bucket_path_without_its_library_names_the_extra(tmp_path):
    # gcsfs hidden as if not installed (None in sys.modules makes `import gcsfs` fail): before,
    # the run ended in fsspec's ImportError traceback, exit 1 (issue 55, item 1).
    hide_and_run = ("import runpy, sys; sys.modules['gcsfs'] = None; sys.argv[0] = 'train'; "
                    "runpy.run_module('jaxscale.train', run_name='__main__')")
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", hide_and_run, "--config=configs/tiny.py", f"--workdir={workdir}",
         "--config.checkpoint.dir=gs://BUCKET/a", "--config.train.steps=2"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.dir='gs://BUCKET/a'"), lines
    assert "gcsfs" in lines[0] and "pip install 'jaxscale[cloud]'" in lines[0]
    assert not os.path.exists(workdir)


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_servers_hold_what_is_written(server, request):
    # The fixtures' own check: the library reaches the server by the standard variables alone.
    bucket = request.getfixturevalue(server).bucket
    fs, root = filesystem(f"{bucket}/check", "test")
    fs.pipe({f"{root}/a/x.txt": b"0123456789", f"{root}/b/y.txt": b"abc"})
    assert sorted(fs.glob(f"{root}/**/*.txt")) == [f"{root}/a/x.txt", f"{root}/b/y.txt"]
    assert fs.cat_file(f"{root}/a/x.txt", start=2, end=5) == b"234"



def test_tensorstore_reads_the_gcs_servers_generations(gcs):
    # TensorStore (Orbax's arrays) reaches the server by TENSORSTORE_GCS_HTTP_URL alone, and the
    # server sends each object's generation: a read conditioned on the generation read (its
    # cache, OCDBT's manifest in every save) is made. gcp-storage-emulator sent none, and
    # TensorStore refused its own condition on generation 0 ("Malformed StorageGeneration").
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "gcs", "bucket": gcs.bucket.removeprefix("gs://"),
                          "path": f"generations-{os.getpid()}/"}).result()
    written = kv.write("a", b"0123456789").result().generation
    read = kv.read("a").result()
    assert read.value == b"0123456789" and read.stamp.generation == written
    again = kv.read("a", if_not_equal=read.stamp.generation).result()
    assert again.state in ("unspecified", "value") and again.stamp.generation == written


@pytest.mark.parametrize("server", ["gcs", "s3"])
@pytest.mark.parametrize("name", ["jsonl", "text_lines", "text_files", "tokens", "parquet"])
def test_sources_in_a_bucket_read_as_from_local_disk(server, name, request, tmp_path,
                                                     monkeypatch):
    local = write_fixture(tmp_path, name)
    bucket = f"{request.getfixturevalue(server).bucket}/{name}-{os.getpid()}"
    put(f"{tmp_path}/", f"{bucket}/")
    fs, _ = filesystem(bucket, "test")
    in_bucket = dict(local, path=local["path"].replace(str(tmp_path), bucket))
    listings = []  # a glob lists with `_find` (the sync `glob` is bound when fs is made)
    real_find = type(fs)._find

    async def find(self, path, *args, **kwargs):
        listings.append(path)
        return await real_find(self, path, *args, **kwargs)
    monkeypatch.setattr(type(fs), "_find", find)
    for split in ("train", "eval"):  # the same order, documents and split
        expected = decoded(config_with(dict(local, eval_fraction=0.1)), split)
        assert decoded(config_with(dict(in_bucket, eval_fraction=0.1)), split) == expected
    # Listed once for both splits: an object store bills (and may throttle) every listing.
    assert len(listings) == (1 if name == "text_files" else 0), listings


def put(local: str, url: str) -> None:
    """The local file or folder `local` copied to `url`, one object at a time: the GCS emulator
    resets connections when uploads come together, and gcsfs' retries after each reset back off
    (120 small files took 110 s, against 0.3 s one at a time)."""
    fs, root = filesystem(url, "test")
    fs.put(local, root, recursive=os.path.isdir(local), batch_size=1)


def uploaded(local: str, server) -> str:
    """The local file or folder `local` copied into `server`'s bucket; its URL there."""
    url = f"{server.bucket}/{os.getpid()}/{os.path.basename(local)}"
    put(local, url)
    return url


def test_array_record_in_a_bucket_is_refused_in_one_line(gcs, tmp_path):
    # array_record's reader takes local paths only: refused at start, saying what to do.
    url = uploaded(str(write_fixture(tmp_path, "array_record")["path"]), gcs)
    message = one_line_error(
        ConfigError, lambda: decoded(config_with(dict(format="array_record", path=url)), "train"))
    assert message.startswith(f"ArrayRecord file {url!r} is in a bucket") and "prepare" in message


@pytest.mark.parametrize("server", ["gcs", "s3"])
@pytest.mark.parametrize("kind", ["sentencepiece_model", "huggingface_tokenizer"])
def test_a_tokenizer_file_in_a_bucket_is_the_local_one(server, kind, request):
    local = request.getfixturevalue(kind)
    url = uploaded(local, request.getfixturevalue(server))
    special = dict(bos_token="<s>", eos_token="</s>") if kind == "huggingface_tokenizer" else {}
    tokenizers = [tokenizer_from_config(config_with(dict(format="synthetic"), tokenizer=path,
                                                    **special)) for path in (local, url)]
    # The name (a hash of the content) is what token files are checked against.
    assert tokenizers[0].name == tokenizers[1].name
    text = "document 3: the same ids from either"
    np.testing.assert_array_equal(tokenizers[1].encode(text), tokenizers[0].encode(text))


# Each prepare spawns its tokenizing processes (tens of seconds here): one server by default.
@pytest.mark.parametrize("server", [pytest.param("gcs", marks=pytest.mark.slow), "s3"])
def test_prepare_writes_token_files_into_a_bucket(server, request, tmp_path):
    # `python -m jaxscale.data.prepare --out=gs://...` runs this: the files it writes into the
    # bucket, and the sources it prints, train on the documents the local files hold.
    config = config_with(write_fixture(tmp_path, "jsonl"))
    out = f"{request.getfixturevalue(server).bucket}/prepared-{os.getpid()}"
    in_bucket = prepare.prepare(config, out, workers=1)
    local = prepare.prepare(config, str(tmp_path / "local"), workers=1)
    assert [s["path"] for s in in_bucket] == [f"{out}/source0.train.bin"]
    for split in ("train", "eval"):
        assert decoded(config_with(*in_bucket), split) == decoded(config_with(*local), split)
    fs, root = filesystem(out, "test")
    for name in ("source0.train.bin", "source0.train.idx.npy", "prepare.json"):
        assert fs.cat_file(f"{root}/{name}") == (tmp_path / "local" / name).read_bytes()
    # The bucket's manifest is read back: another tokenizer is refused, nothing overwritten.
    other = config_with(*config.data.sources, tokenizer=request.getfixturevalue(
        "sentencepiece_model"))
    assert "already holds token files of another config" in one_line_error(
        JaxscaleError, lambda: prepare.prepare(other, out, workers=1))


def test_reads_in_flight_keep_the_order_of_local_disk(s3, tmp_path):
    # A bucket source reads each stream's next documents ahead, on threads: the batches are those
    # of local disk read one document at a time, and the position it saves, with documents read
    # ahead and not yet returned, resumes a local-disk run exactly where it stopped.
    local = write_fixture(tmp_path, "tokens")
    bucket = f"{s3.bucket}/in-flight-{os.getpid()}"
    put(f"{tmp_path}/", f"{bucket}/")
    in_bucket = dict(local, path=local["path"].replace(str(tmp_path), bucket))
    ahead, one_at_a_time = config_with(in_bucket), config_with(local, workers=0)
    assert reads_a_bucket(ahead) and not reads_a_bucket(one_at_a_time)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
    expected = take(one_at_a_time, "train", sharding, 6)
    assert_same(take(ahead, "train", sharding, 6), expected)
    read_ahead = make_input(ahead, "train", sharding)
    try:
        assert_same([jax.device_get(next(read_ahead)) for _ in range(3)], expected[:3])
        state = read_ahead.get_state()
    finally:
        read_ahead.close()
    resumed = make_input(one_at_a_time, "train", sharding)
    try:
        resumed.set_state(state)
        assert_same([jax.device_get(next(resumed)) for _ in range(3)], expected[3:])
    finally:
        resumed.close()


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_a_bucket_that_does_not_exist_is_named_at_start(server, request, tmp_path):
    scheme = request.getfixturevalue(server).bucket.split(":")[0]
    source = dict(format="jsonl", path=f"{scheme}://no-such-bucket/texts.jsonl")
    message = one_line_error(ConfigError, lambda: decoded(config_with(source), "train"))
    assert message.startswith(f"data.sources[0].path={source['path']!r}: bucket "
                              f"{scheme}://no-such-bucket does not exist"), message
    if scheme == "gs":  # Orbax keeps none in s3:// anyway
        config = small_config()
        config.checkpoint.dir = "gs://no-such-bucket/run"
        message = one_line_error(ConfigError, Checkpoints(config, str(tmp_path)).check_writable)
        assert "bucket gs://no-such-bucket does not exist" in message, message


@pytest.mark.parametrize("server", [pytest.param("gcs", marks=pytest.mark.slow), "s3"])
def test_a_server_that_does_not_answer_is_transient_at_start(server, request, monkeypatch):
    # gcsfs tries for about a minute (its own retries) before it gives up: with the slow tests.
    bucket = request.getfixturevalue(server).bucket
    dead = f"http://127.0.0.1:{free_port()}"
    variables = gcs_variables(dead) if bucket.startswith("gs") else s3_variables(dead)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    scheme = bucket.split(":")[0]
    fsspec.get_filesystem_class(scheme).clear_instance_cache()  # made with the live endpoint
    try:
        source = dict(format="jsonl", path=f"{bucket}/data/texts.jsonl")
        message = one_line_error(TransientError, lambda: decoded(config_with(source), "train"))
    finally:
        fsspec.get_filesystem_class(scheme).clear_instance_cache()
    assert f"bucket {bucket} cannot be reached" in message and "127.0.0.1" in message, message


def test_credentials_the_server_refuses_are_named_at_start():
    # The server's own refusal (403 for an access key it does not know), not one made up here:
    # exit 2 before anything is read, naming the bucket, the account and the fix.
    source = dict(format="jsonl", path="s3://refusing-bucket/texts.jsonl")
    with s3_server_refusing_credentials():
        message = one_line_error(ConfigError, lambda: decoded(config_with(source), "train"))
    assert message.startswith(f"data.sources[0].path={source['path']!r}: bucket "
                              "s3://refusing-bucket refused AWS access key test (Forbidden)")
    assert "grant that account access to the bucket" in message and "s3:GetObject" in message


# 503 in the default suite; 429 and 500 take the same path, each about 12 s (the client's retries).
@pytest.mark.parametrize("status", [503, pytest.param(429, marks=pytest.mark.slow),
                                    pytest.param(500, marks=pytest.mark.slow)])
def test_a_server_answering_5xx_or_429_at_start_is_transient(s3, status, monkeypatch):
    # Answered by a proxy in front of the live server (moto cannot be made to): botocore retries
    # (5 requests in all, seconds), then exit 75 naming the bucket; the launcher retries later.
    with FaultProxy(s3.url) as proxy:
        for name, value in s3_variables(proxy.url).items():
            monkeypatch.setenv(name, value)
        fsspec.get_filesystem_class("s3").clear_instance_cache()  # made with the live endpoint
        try:
            source = dict(format="jsonl", path=f"{s3.bucket}/data/texts.jsonl")
            proxy.status = status
            message = one_line_error(TransientError,
                                     lambda: decoded(config_with(source), "train"))
        finally:
            fsspec.get_filesystem_class("s3").clear_instance_cache()
    assert message.startswith(f"data.sources[0].path={source['path']!r}: bucket {s3.bucket} "
                              "cannot be reached (") and message.endswith("the storage is failing")
    assert proxy.requests > 1  # the library's own retries came first


# gcsfs retries a 503 for about 30 s (its own backoff) before it gives up: with the slow tests.
@pytest.mark.parametrize("status", [403, pytest.param(503, marks=pytest.mark.slow)])
def test_what_a_gcs_server_answers_at_start_is_classified(gcs, status, monkeypatch):
    # 403: refused (exit 2, the account named); 503 after gcsfs' retries: failing (exit 75).
    with FaultProxy(gcs.url) as proxy:
        for name, value in gcs_variables(proxy.url).items():
            monkeypatch.setenv(name, value)
        fsspec.get_filesystem_class("gs").clear_instance_cache()  # made with the live endpoint
        try:
            source = dict(format="jsonl", path=f"{gcs.bucket}/data/texts.jsonl")
            proxy.status = status
            message = one_line_error(ConfigError if status == 403 else TransientError,
                                     lambda: decoded(config_with(source), "train"))
        finally:
            fsspec.get_filesystem_class("gs").clear_instance_cache()
    where = f"data.sources[0].path={source['path']!r}: bucket {gcs.bucket} "
    if status == 403:
        assert message.startswith(where + "refused ") and "roles/storage.objectUser" in message
    else:
        assert message.startswith(where + "cannot be reached (") and "503" in message
        assert message.endswith("the storage is failing") and proxy.requests > 1


# gcsfs retries a 503 for about 30 s before it gives up, and s3's case trains as long: with the
# slow tests (the default suite keeps the 5xx/429 at start, and test_bucket_paths' mid-read cases).
@pytest.mark.slow
@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_a_server_failing_mid_run_stops_the_read_as_transient(server, request, tmp_path,
                                                              monkeypatch):
    # The sources were listed and opened; then every request is answered 503: the document's
    # read raises exit 75 (the launcher retries), never a skipped record or a traceback.
    live = request.getfixturevalue(server)
    local = write_fixture(tmp_path, "tokens")
    url = uploaded(str(tmp_path), live)
    source = dict(local, path=local["path"].replace(str(tmp_path), url))
    scheme = live.bucket.split(":")[0]
    variables = gcs_variables if scheme == "gs" else s3_variables
    with FaultProxy(live.url) as proxy:
        for name, value in variables(proxy.url).items():
            monkeypatch.setenv(name, value)
        fsspec.get_filesystem_class(scheme).clear_instance_cache()
        try:
            documents = sources.source_documents(source_specs(config_with(source))[0], "train",
                                                 ByteTokenizer(), config_with(source))
            proxy.status = 503
            message = one_line_error(TransientError, lambda: documents[0])
        finally:
            fsspec.get_filesystem_class(scheme).clear_instance_cache()
    assert message.startswith(f"cannot read {source['path']!r} (") and proxy.requests > 1
    assert message.endswith("the storage is failing"), message


@pytest.mark.slow
def test_a_slow_server_slows_training_and_shows_as_input_wait(s3, tmp_path, monkeypatch):
    # Every answer of the server half a second late: training goes on and takes the steps of
    # local disk, and the time shows as waiting on input (data_wait_fraction), not lost. Read
    # when its row needs it (data.read_ahead=0; 8 streams at once): reading ahead hides the wait
    # of some steps, by as much as the run's compilation took, which moves with the load.
    monkeypatch.setenv("XLA_FLAGS", "")
    local = write_fixture(tmp_path, "tokens")
    url = uploaded(str(tmp_path), s3)
    source = dict(local, path=local["path"].replace(str(tmp_path), url))
    reads = {"data.read_ahead": "0", "data.workers": "8"}
    on_disk, _ = resumable_cli_losses(tmp_path / "disk", 3, **{"data.sources": repr((local,)),
                                                               **reads})
    with FaultProxy(s3.url) as proxy:
        for name, value in s3_variables(proxy.url).items():
            monkeypatch.setenv(name, value)
        proxy.delay = 0.5
        slow, _ = resumable_cli_losses(tmp_path / "slow", 3, **{"data.sources": repr((source,)),
                                                                **reads})
    assert slow == on_disk
    # Seconds each timed step waited for its batch (prefetch hides part of the delay): about 2 s
    # here, against a millisecond from local disk.
    slow_waits, disk_waits = input_waits(tmp_path / "slow"), input_waits(tmp_path / "disk")
    assert slow_waits and min(slow_waits) > max(0.2, 10 * max(disk_waits)), (slow_waits,
                                                                             disk_waits)


def input_waits(workdir) -> list[float]:
    """The seconds per step that the run in `workdir` waited on its input, by logged window."""
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return [line["data_wait_fraction"] * line["step_time"] for line in lines
            if "data_wait_fraction" in line]


@pytest.mark.slow  # trains, damages and restores in the bucket (about 15 s)
def test_damaged_checkpoint_in_a_bucket_is_marked_not_renamed(gcs, tmp_path, caplog):
    # A bucket renames by copying and deleting each object, which a crash leaves half done: the
    # verdict is one marker object, and the damaged objects stay until the step is saved again.
    config = small_config()
    config.checkpoint.update(dir=f"{gcs.bucket}/damaged", compilation_cache=False)
    trainer = Trainer(config, str(tmp_path), devices=jax.devices()[:1])
    state = trainer.program.init_state(0)

    def save(step: int) -> None:
        with Checkpoints(config, str(tmp_path)) as checkpoints:
            checkpoints.save(step, state, {}, {"step": step})
    for step in (1, 2):
        save(step)
    fs, root = filesystem(config.checkpoint.dir, "checkpoint.dir")
    fs.rm(f"{root}/2/params/_METADATA")
    before = set(fs.find(f"{root}/2"))

    with caplog.at_level(logging.WARNING), Checkpoints(config, str(tmp_path)) as checkpoints:
        assert checkpoints.restore_newest(trainer.program.abstract_state).meta["step"] == 1
    fs.invalidate_cache()
    markers = [p for p in fs.ls(root) if re.fullmatch(r".*/2\.corrupt-\d+", p)]
    assert len(markers) == 1 and "_METADATA" in fs.cat_file(markers[0]).decode()
    assert set(fs.find(f"{root}/2")) == before  # nothing moved
    assert any("is damaged" in r.getMessage() and "marked 2.corrupt-" in r.getMessage()
               for r in caplog.records)

    def restore_then_save() -> None:  # the next start skips step 2 without reading it again
        caplog.clear()
        with caplog.at_level(logging.WARNING), Checkpoints(config, str(tmp_path)) as checkpoints:
            assert checkpoints.restore_newest(trainer.program.abstract_state).meta["step"] == 1
            assert not any("is damaged" in r.getMessage() for r in caplog.records)
            checkpoints.save(2, state, {}, {"step": 2})  # opening for saving removes the damaged 2
    restore_then_save()
    fs.invalidate_cache()
    assert not fs.exists(markers[0])
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        assert checkpoints.restore_newest(trainer.program.abstract_state).meta["step"] == 2


def test_checkpoints_in_s3_are_refused_in_one_line(s3, tmp_path):
    # Orbax hands s3:// paths to its array writer as local ones ("s3:/..."): the first save
    # failed after the step compiled and trained, with tracebacks.
    config = small_config()
    config.checkpoint.dir = f"{s3.bucket}/run"
    message = one_line_error(ConfigError, Checkpoints(config, str(tmp_path)).check_writable)
    assert message.startswith(f"checkpoint.dir='{s3.bucket}/run': Orbax keeps checkpoints in a "
                              "local folder or a gs:// bucket only (it hands TensorStore's "
                              "bucket drivers gs:// paths alone"), message


def test_orbax_alone_keeps_checkpoints_out_of_s3(s3):
    # Why the refusal above: TensorStore writes OCDBT (Orbax's array format) through its s3
    # driver, and epath (Orbax's other files) through s3fs, to the server; Orbax's array spec
    # takes the s3:// path for a relative local one. When it no longer does, lift the refusal.
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils

    root = f"{s3.bucket}/orbax-{os.getpid()}"
    ocdbt = ts.KvStore.open({"driver": "ocdbt", "base": {
        "driver": "s3", "bucket": s3.bucket.removeprefix("s3://"), "path": f"orbax-{os.getpid()}/",
        "endpoint": os.environ["AWS_ENDPOINT_URL"], "aws_region": "us-east-1"}}).result()
    ocdbt.write("params", b"arrays").result()
    assert ocdbt.read("params").result().value == b"arrays"
    (epath.Path(root) / "_CHECKPOINT_METADATA").write_text("{}")
    assert (epath.Path(root) / "_CHECKPOINT_METADATA").read_text() == "{}"
    with pytest.raises(ValueError, match="should be absolute. Got s3:/"):
        tensorstore_utils.build_kvstore_tspec(f"{root}/1/params", use_ocdbt=True)


@pytest.mark.slow
def test_tiny_from_buckets_trains_and_resumes_as_from_local_disk(gcs, s3, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    (tmp_path / "data").mkdir()
    data = write_fixture(tmp_path / "data", "jsonl")
    for server in (gcs, s3):
        fs, root = filesystem(f"{server.bucket}/data", "test")
        fs.put(data["path"], f"{root}/texts.jsonl")

    def source(root):
        return {"data.sources": repr((dict(data, path=f"{root}/texts.jsonl"),))}
    on_disk, _ = resumable_cli_losses(tmp_path / "disk", 4, **source(tmp_path / "data"))
    # Data in s3://, checkpoints on disk (Orbax writes none to s3://).
    from_s3, _ = resumable_cli_losses(tmp_path / "s3", 4, **source(f"{s3.bucket}/data"))
    assert from_s3 == on_disk
    # Stopped at step 2 and resumed from the bucket to 4, data and checkpoints in gs://;
    # metrics.jsonl holds both runs' steps: 1 and 2 from the first, 3 and 4 resumed.
    in_gcs = {**source(f"{gcs.bucket}/data"), "checkpoint.dir": f"{gcs.bucket}/resume"}
    first, _ = resumable_cli_losses(tmp_path / "gcs", 2, **in_gcs)
    assert first == {step: on_disk[step] for step in (1, 2)}
    resumed, out = resumable_cli_losses(tmp_path / "gcs", 4, **in_gcs)
    assert f"restored {gcs.bucket}/resume/2" in out, out
    assert resumed == on_disk
    fs, root = filesystem(f"{gcs.bucket}/resume", "test")
    assert {"2", "4"} <= {p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}


def test_orbax_gives_tensorstore_the_bounded_bucket_retries():
    # Orbax builds the TensorStore context of every save and restore from the defaults that
    # jaxscale/checkpoint/bucket_retries.py bounds: when a release stops doing so, this fails
    # (and a save into a failing bucket waits out TensorStore's own 32 retries again).
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import tensorstore_utils

    from jaxscale.checkpoint.bucket_retries import GCS_REQUEST_RETRIES

    bounded = ts.Context.Spec({"gcs_request_retries": GCS_REQUEST_RETRIES}).to_json()
    for ocdbt in (True, False):
        spec = tensorstore_utils.get_ts_context(use_ocdbt=ocdbt).spec.to_json()
        assert spec["gcs_request_retries"] == bounded["gcs_request_retries"], spec


# Slow: the libraries' bounded retries take about 30 s per failed save, two saves fail.
@pytest.mark.slow
@pytest.mark.parametrize("status", [503, 429])
def test_a_bucket_failing_mid_save_stops_the_run_as_transient(gcs, status, tmp_path, monkeypatch):
    # From step 4 on, the bucket answers `status` to every write of a checkpoint: TensorStore and
    # gcsfs retry each request (bounded: jaxscale/checkpoint/bucket_retries.py; TensorStore's
    # default held a save over 9.5 minutes), the save of 4 fails, training goes on and the save
    # of 6, the last, tries again (as on a local disk), fails, and the run stops: exit 75, one
    # error line.
    # Step 2 restores and the resumed run takes the steps the failing run took.
    monkeypatch.setenv("XLA_FLAGS", "")
    run = f"{gcs.bucket}/failing-{status}-{os.getpid()}"
    workdir = tmp_path / "run"
    with FaultProxy(gcs.url) as proxy:
        for name, value in gcs_variables(proxy.url).items():
            monkeypatch.setenv(name, value)
        proxy.writes_status = status
        # An object's name without its bucket: the JSON API names the bucket elsewhere.
        proxy.writes_matching = rf"{re.escape(run.split('/', 3)[3])}/[3-9]"
        result = resumable_cli_run(workdir, 6, **{"checkpoint.dir": run})
    assert result.returncode == 75, result.stdout[-2000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: checkpoint {run}/6 could not be written; the checkpoints before it are intact"
    ), result.stderr[-3000:]
    assert str(status) in errors[0], errors
    # The save of 4 failed first, and training went on to try again at 6.
    log = (workdir / "train.log").read_text(encoding="utf-8")
    assert f"checkpoint {run}/4 could not be written" in log
    assert "Training goes on and the next save tries again (1 failed in a row" in log
    # The bound, in requests rather than seconds: each write was tried again and given up
    # after 6 tries at most (TensorStore's default makes 33, over 9.5 minutes).
    assert proxy.failed_writes and max(proxy.failed_writes.values()) in range(2, 7), \
        proxy.failed_writes
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        failing = {line["step"]: line["loss"] for line in map(json.loads, f) if "loss" in line}
    # Step 6's line is written after its save, which failed: the steps before it are there.
    assert {1, 2, 3, 4, 5} <= set(failing), failing

    for name, value in gcs_variables(gcs.url).items():  # the server itself again
        monkeypatch.setenv(name, value)
    resumed, out = resumable_cli_losses(workdir, 6, **{"checkpoint.dir": run})
    assert f"restored {run}/2" in out, out
    assert {step: resumed[step] for step in failing} == failing and 6 in resumed


@pytest.mark.slow
def test_export_hf_writes_the_folder_into_a_bucket(gcs, s3, tmp_path, monkeypatch):
    # `python -m jaxscale.export_hf --out=gs://...` (or s3://): the folder a local export
    # writes, file for file, byte for byte.
    monkeypatch.setenv("XLA_FLAGS", "")
    resumable_cli_losses(tmp_path / "run", 2)
    local = tmp_path / "local"
    export(str(tmp_path / "run"), str(local), None, "float32")
    for server in (gcs, s3):
        out = f"{server.bucket}/export-{os.getpid()}"
        assert out in export(str(tmp_path / "run"), out, None, "float32")
        fs, root = filesystem(out, "test")
        assert sorted(os.path.basename(p) for p in fs.ls(root, detail=False)) == \
            sorted(os.listdir(local))
        for name in os.listdir(local):
            assert fs.cat_file(f"{root}/{name}") == (local / name).read_bytes(), name
        # A folder that holds files is refused, as on a local disk.
        assert "is not an empty folder" in one_line_error(
            JaxscaleError, lambda: export(str(tmp_path / "run"), out, None, "float32"))
