"""Data and checkpoints in buckets (gs://, s3://), against real storage servers on loopback ports
(tests/storage_servers.py), and what a bucket path does without the `cloud` extra."""

import os
import subprocess
import sys

import pytest

from jaxscale.runtime.storage import filesystem
from tests.helpers import REPO
from tests.storage_servers import gcs, s3  # noqa: F401 (fixtures)


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
