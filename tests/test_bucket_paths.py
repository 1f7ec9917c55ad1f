"""The rest of the paths in buckets (gs://, s3://), against the local servers of
tests/storage_servers.py: TensorBoard's folder, `checkpoint.restore_from` (a Hugging Face folder,
another run's checkpoints) and the sampler's `--workdir` and `--hf`."""

import struct

import pytest

from jaxscale.observe.trackers import check_tracker_access, open_trackers
from jaxscale.runtime.storage import filesystem
from tests.helpers import small_config
from tests.storage_servers import gcs, s3  # noqa: F401 (fixtures)


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
