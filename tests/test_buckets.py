"""Data and checkpoints in buckets (gs://, s3://), against real storage servers on loopback ports
(tests/storage_servers.py), and what a bucket path does without the `cloud` extra."""

import os
import subprocess
import sys

from tests.helpers import REPO


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
