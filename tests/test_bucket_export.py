"""`python -m jaxscale.export_hf --workdir=gs://...`: a run whose workdir (its config.json and
checkpoints) is in a bucket exports as the same run does from local disk, against a GCS-API
server on a loopback port (tests/storage_servers.py)."""

import os

import pytest

from jaxscale.export_hf import main as export_main
from jaxscale.runtime.storage import filesystem
from tests.helpers import resumable_cli_losses
from tests.storage_servers import gcs  # noqa: F401 (fixture)


def exit_status(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        export_main(argv)
    return exited.value.code


def test_a_workdir_in_a_missing_bucket_is_named_in_one_line(gcs, tmp_path, capsys):
    out = tmp_path / "out"
    assert exit_status([f"--workdir=gs://no-such-bucket-{os.getpid()}/run",
                        f"--out={out}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"bucket gs://no-such-bucket-{os.getpid()} does not exist" in lines[0], lines
    assert not out.exists()


@pytest.mark.slow  # trains the tiny model 2 steps through the CLI, exports twice
def test_a_workdir_in_a_bucket_exports_as_from_local_disk(gcs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")
    run = tmp_path / "run"
    resumable_cli_losses(run, 2)
    bucket_run = f"{gcs.bucket}/run-{os.getpid()}"
    fs, root = filesystem(bucket_run, "test")
    fs.put(f"{run}/", f"{root}/", recursive=True)  # config.json and checkpoints/, as they are

    local = tmp_path / "local"
    export_main([f"--workdir={run}", f"--out={local}", "--dtype=float32"])
    bucket_out = f"{gcs.bucket}/export-{os.getpid()}"
    export_main([f"--workdir={bucket_run}", f"--out={bucket_out}", "--dtype=float32"])
    printed = capsys.readouterr().out
    assert f"step 2 of {bucket_run} to {bucket_out}" in printed, printed

    names = sorted(os.listdir(local))
    assert "config.json" in names and any(n.endswith(".safetensors") for n in names)
    _, out_root = filesystem(bucket_out, "test")
    assert sorted(os.path.basename(p) for p in fs.ls(out_root, detail=False)) == names
    for name in names:  # the same bytes: every tensor, its dtype and the headers
        expected = (local / name).read_bytes()
        assert fs.cat_file(f"{out_root}/{name}") == expected, name
