"""The rest of the paths in buckets (gs://, s3://), against the local servers of
tests/storage_servers.py: TensorBoard's folder, `checkpoint.restore_from` (a Hugging Face folder,
another run's checkpoints) and the sampler's `--workdir` and `--hf`."""

import json
import os
import struct
import subprocess
import sys

import fsspec
import pytest

import jaxscale.config
from jaxscale.config import default_config
from jaxscale.data import sources
from jaxscale.data.sources import source_specs
from jaxscale.data.tokenizers import ByteTokenizer
from jaxscale.errors import TransientError
from jaxscale.hf import bucket_folder
from jaxscale.observe.trackers import check_tracker_access, open_trackers
from jaxscale.runtime.storage import filesystem
from jaxscale.sample import main as sample_main
from jaxscale.trainer import Trainer
from tests.fault_proxy import FaultProxy
from tests.helpers import REPO, config_with, one_line_error, small_config
from tests.storage_servers import gcs, gcs_variables, s3  # noqa: F401 (fixtures)
from tests.test_buckets import put
from tests.test_data_sources import write_fixture

HF_FOLDER = os.path.join(REPO, "tests", "fixtures", "hf_tied")


def scalars(event_file: bytes) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} of the scalars in a TensorBoard event file, read by the TFRecord
    framing (length, its CRC, the Event, its CRC) and the Event proto."""
    from tensorboardX.proto.event_pb2 import Event

    found, at = {}, 0
    while at < len(event_file):
        (length,) = struct.unpack("<Q", event_file[at:at + 8])
        event = Event.FromString(event_file[at + 12:at + 12 + length])
        at += 12 + length + 4
        for value in event.summary.value:
            found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_tensorboard_writes_its_event_file_into_a_bucket(server, request, tmp_path):
    folder = f"{request.getfixturevalue(server).bucket}/tensorboard-{tmp_path.name}"
    config = small_config()
    config.metrics.update(trackers=("tensorboard",), tensorboard_dir=folder)
    check_tracker_access(config, str(tmp_path))
    (tracker,) = open_trackers(str(tmp_path), config)
    tracker.write(1, {"loss": 2.5}, "")
    tracker.write(2, {"loss": 1.25}, "")
    tracker.close(failed=False)
    fs, root = filesystem(folder, "test")
    (event_file,) = fs.ls(root, detail=False)
    assert scalars(fs.cat_file(event_file)) == {"train/loss": [(1, 2.5), (2, 1.25)]}
    assert not (tmp_path / "tensorboard").exists()  # nothing in the workdir's usual place


def float32_default_config():
    config = default_config()
    config.precision.compute_dtype = "float32"  # so that a local and a bucket's sample agree
    return config


def sampled(capsys, *flags: str) -> str:
    """What `python -m jaxscale.sample` prints for the greedy continuation of one prompt."""
    sample_main([*flags, "--prompt=w1 w5 w9 w2", "--max_new_tokens=10", "--temperature=0"])
    return capsys.readouterr().out


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_the_sampler_continues_a_hugging_face_folder_in_a_bucket_as_on_disk(
        server, request, monkeypatch, capsys):
    # --hf=gs://... (or s3://): the folder is copied once, its config, tokenizer and weights
    # read from the copy by checkpoint.restore_from's reader, the same greedy text.
    url = f"{request.getfixturevalue(server).bucket}/hf-{os.getpid()}"
    put(HF_FOLDER, url)
    monkeypatch.setattr(jaxscale.config, "default_config", float32_default_config)
    expected = sampled(capsys, f"--hf={HF_FOLDER}")
    assert sampled(capsys, f"--hf={url}") == expected and expected.strip()
    assert sorted(os.listdir(bucket_folder.local_folder(url, "test"))) == \
        sorted(os.listdir(HF_FOLDER))  # the one copy the sampler made


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, request):
    """(a small run trained 2 steps on synthetic tokens, its checkpoint at step 2; the same
    workdir copied into the GCS bucket)."""
    workdir = str(tmp_path_factory.mktemp("bucket_paths") / "run")
    config = small_config(data=-1)
    config.train.steps = 2
    config.data.sources = (dict(format="synthetic"),)
    config.checkpoint.compilation_cache = False
    Trainer(config, workdir).run()
    url = f"{request.getfixturevalue('gcs').bucket}/runs-{os.getpid()}/run"
    put(workdir, url)
    return workdir, url


# The fixture trains a run (7 s on the 2-core VM alone, 30-40 s loaded): with the slow tests.
@pytest.mark.slow
def test_the_sampler_continues_a_workdir_in_a_bucket_as_on_disk(trained_run, capsys):
    # --workdir=gs://...: its config.json read there, its checkpoints restored from there.
    workdir, url = trained_run
    expected = sampled(capsys, f"--workdir={workdir}")
    assert sampled(capsys, f"--workdir={url}") == expected and expected.strip()


@pytest.mark.slow
def test_a_run_restoring_from_a_run_in_a_bucket_starts_as_from_local_disk(trained_run,
                                                                          tmp_path):
    # checkpoint.restore_from=gs://<another run>: the first loss of the new run is the one a
    # start from the same run on local disk gives.
    first_losses = []
    for source in trained_run:
        config = small_config(data=-1)
        config.train.steps = 3  # one step past the restored step 2: params, optimizer, data
        config.data.sources = (dict(format="synthetic"),)
        config.checkpoint.update(restore_from=source, compilation_cache=False)
        workdir = tmp_path / str(len(first_losses))
        Trainer(config, str(workdir)).run()
        with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
            lines = [json.loads(line) for line in f]
        first_losses.append([(line["step"], line["loss"]) for line in lines if "loss" in line])
    assert first_losses[0] == first_losses[1] and first_losses[0][0][0] == 3  # restored at 2


class _NoBackoff:
    """What gcsfs' retries wait with (its `asyncio.sleep`), not waiting: its six tries of a
    request answered 503 take milliseconds rather than 30 s."""

    @staticmethod
    async def sleep(seconds: float) -> None:
        return None


# Parquet is left out: a small file's bytes are all read (and cached) when it is opened.
@pytest.mark.parametrize("name", ["jsonl", "text_files", "tokens"])
def test_a_gcs_server_failing_mid_read_is_transient(name, request, tmp_path, monkeypatch):
    # The sources were listed; then every request is answered 503: gcsfs retries, then raises
    # its HttpError (no OSError), which each read site classifies as the storage failing
    # (exit 75), never a traceback or "malformed".
    import gcsfs.retry

    monkeypatch.setattr(gcsfs.retry, "asyncio", _NoBackoff)
    server = request.getfixturevalue("gcs")
    local = write_fixture(tmp_path, name)
    url = f"{server.bucket}/mid-read-{name}-{os.getpid()}"
    put(f"{tmp_path}/", f"{url}/")
    source = dict(local, path=local["path"].replace(str(tmp_path), url))
    config = config_with(source)
    with FaultProxy(server.url) as proxy:
        for key, value in gcs_variables(proxy.url).items():
            monkeypatch.setenv(key, value)
        fsspec.get_filesystem_class("gs").clear_instance_cache()
        try:
            documents = sources.source_documents(source_specs(config)[0], "train",
                                                 ByteTokenizer(), config)
            proxy.status = 503
            message = one_line_error(TransientError, lambda: documents[0])
        finally:
            fsspec.get_filesystem_class("gs").clear_instance_cache()
    assert message.startswith("cannot read ") and "503" in message, message
    assert message.endswith("the storage is failing") and proxy.requests > 1, message


@pytest.mark.parametrize("flags", [
    ["jaxscale.sample", "--hf=gs://BUCKET/model", "--prompt=def"],
    ["jaxscale.train", "--config=configs/tiny.py", "--config.train.steps=2", "--workdir={}",
     "--config.metrics.tensorboard_dir=gs://BUCKET/tb"]], ids=["sample", "tensorboard"])
def test_the_new_bucket_paths_without_their_library_name_the_extra(flags, tmp_path):
    # gcsfs hidden as if not installed (None in sys.modules makes `import gcsfs` fail).
    module, *args = flags
    hide_and_run = (f"import runpy, sys; sys.modules['gcsfs'] = None; sys.argv[0] = '{module}'; "
                    f"runpy.run_module('{module}', run_name='__main__')")
    workdir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", hide_and_run,
                             *(arg.format(workdir) for arg in args)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    key = "--hf" if module == "jaxscale.sample" else "metrics.tensorboard_dir"
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}='gs://BUCKET/"), lines
    assert "gcsfs" in lines[0] and "pip install 'jaxscale[cloud]'" in lines[0], lines
    assert not workdir.exists()


@pytest.mark.parametrize("server", ["gcs", "s3"])
def test_configs_hf_takes_a_folder_in_a_bucket(server, request):
    # --config=configs/hf.py:gs://...: the model section and BOS/EOS of the local folder; the
    # tokenizer and the weights named in the bucket, where every process reads them.
    from jaxscale.cli import load_config_file

    url = f"{request.getfixturevalue(server).bucket}/hf-config-{os.getpid()}"
    put(HF_FOLDER, url)
    local, in_bucket = (load_config_file(f"configs/hf.py:{path}") for path in (HF_FOLDER, url))
    assert in_bucket.data.tokenizer == f"{url}/tokenizer.json"
    assert in_bucket.checkpoint.restore_from == url
    for config in (local, in_bucket):
        config.data.tokenizer = config.checkpoint.restore_from = ""
    assert in_bucket.to_dict() == local.to_dict()
