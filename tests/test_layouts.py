"""Multi-node layouts: one notion of DCN granules (TPU slices, else hosts) shared by the trainer and
the launchers' pre-checks, HSDP (a hybrid mesh across hosts), and the slowest host named in the
metrics. ZeRO-1 optimizer-state sharding: tests/test_zero.py."""

import json
import os
import subprocess
import sys
import types

import pytest

from jaxscale.checks import validate
from jaxscale.errors import ConfigError
from jaxscale.launch.cli import check_train_args
from jaxscale.parallel.mesh import dcn_granules
from jaxscale.trainer import Trainer
from tests.fakes import fake_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- one notion of DCN granules ----------------------------------------------------------------

def fake_devices(processes, per_process, platform):
    """What the trainer sees of a cluster: GPU and CPU devices of a multi-process run report
    slice_index 0 on every host; TPU devices report their slice."""
    return [types.SimpleNamespace(platform=platform, process_index=p, slice_index=0
                                  if platform != "tpu" else p, id=p * per_process + i)
            for p in range(processes) for i in range(per_process)]


LAYOUTS = [  # (overrides, accepted on 2 hosts x 4 devices)
    (["--config.mesh.dcn.data=2", "--config.mesh.fsdp=4", "--config.mesh.data=1"], True),
    (["--config.mesh.dcn.fsdp=2", "--config.mesh.tensor=2", "--config.mesh.data=2"], True),
    (["--config.mesh.dcn.data=2", "--config.mesh.data=-1"], True),
    (["--config.mesh.fsdp=8", "--config.mesh.data=1"], True),  # flat: no DCN factor
    # Two pipeline stages, one per host, FSDP inside each.
    (["--config.mesh.dcn.pipeline=2", "--config.mesh.fsdp=4", "--config.mesh.data=1"], True),
    (["--config.mesh.dcn.data=4", "--config.mesh.data=-1"], False),  # 4 granules asked, 2 exist
    (["--config.mesh.dcn.data=2", "--config.mesh.fsdp=8", "--config.mesh.data=1"], False),
    (["--config.mesh.dcn.tensor=2", "--config.mesh.data=-1",
      "--config.model.n_kv_heads=1"], False),  # tensor=2 does not divide 1 kv head
]


@pytest.mark.parametrize("platform", ["gpu", "cpu", "tpu"])
@pytest.mark.parametrize("overrides, accepted", LAYOUTS)
def test_launcher_pre_checks_and_the_trainer_agree_on_layouts(overrides, accepted, platform,
                                                              capsys):
    """launch.local / launch.fit / Slurm / GKE count hosts (slices on TPU), as the trainer does."""
    args = ["--config=configs/tiny.py", *overrides]
    try:
        check_train_args(args, num_devices=8, num_granules=2)
        launcher_accepts = True
    except SystemExit as e:
        assert e.code == 2
        launcher_accepts = False
    from jaxscale.cli import parse_train_flags
    config, _ = parse_train_flags(["train", *args])
    devices = fake_devices(2, 4, platform)
    try:
        validate(config, len(devices), dcn_granules(config.mesh, devices))
        trainer_accepts = True
    except ConfigError:
        trainer_accepts = False
    capsys.readouterr()
    assert launcher_accepts == trainer_accepts == accepted


# --- real processes: HSDP, the hybrid mesh's device order, the slowest host --------------------

SMALL = ["--config=configs/tiny.py", "--config.train.steps=6", "--config.train.log_every=3",
         "--config.train.seq_len=32", "--config.train.batch_size=8",
         "--config.train.eval_every=0", "--config.model.n_layers=1", "--config.model.d_model=64",
         "--config.model.n_heads=2", "--config.model.n_kv_heads=2", "--config.model.mlp_dim=128",
         "--config.precision.compute_dtype=float32", "--config.checkpoint.enabled=False"]
# Two stages of one layer, 2 microbatches of 4 sequences (one per fsdp device), 1F1B.
PIPELINED = ["--config.model.n_layers=2", "--config.pipeline.microbatches=2",
             "--config.pipeline.schedule=1f1b"]


def launch_two(workdir, *overrides, env=None, module="jaxscale.train"):
    args = [f"--workdir={workdir}"] if module == "jaxscale.train" else []
    return subprocess.run(
        [sys.executable, "-m", "jaxscale.launch.local", "--processes=2",
         "--devices_per_process=4", f"--module={module}", "--", *SMALL, *overrides, *args],
        cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=600)


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def one_process_losses(tmp_path, overrides):
    from jaxscale.cli import parse_train_flags
    config, _ = parse_train_flags(["train", *SMALL, *overrides])
    Trainer(config, str(tmp_path)).run()
    return losses(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("two_hosts, one_host", [
    (["--config.mesh.dcn.data=2", "--config.mesh.fsdp=4", "--config.mesh.data=1",
      "--config.sharding.optimizer_state=data"],
     ["--config.mesh.data=2", "--config.mesh.fsdp=4"]),
    (["--config.mesh.dcn.data=2", "--config.mesh.fsdp=4", "--config.mesh.data=1"],
     ["--config.mesh.data=2", "--config.mesh.fsdp=4"]),
    (["--config.mesh.dcn.fsdp=2", "--config.mesh.tensor=2", "--config.mesh.data=2"],
     ["--config.mesh.fsdp=2", "--config.mesh.tensor=2", "--config.mesh.data=2"]),
    (["--config.mesh.dcn.pipeline=2", "--config.mesh.fsdp=4", "--config.mesh.data=1", *PIPELINED],
     ["--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.mesh.data=1", *PIPELINED]),
], ids=["hsdp_with_zero1", "hsdp", "dcn_fsdp_x_tensor_x_data", "dcn_pipeline_1f1b"])
def test_two_hosts_equal_one_host_with_the_same_logical_layout(tmp_path, two_hosts, one_host):
    run = launch_two(tmp_path / "two", *two_hosts)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    two, one = losses(tmp_path / "two"), one_process_losses(tmp_path / "one", one_host)
    assert sorted(two) == sorted(one) == [3, 6]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("layout, dcn_axis", [
    (["--config.mesh.dcn.data=2", "--config.mesh.fsdp=4", "--config.mesh.data=1"], "data"),
    (["--config.mesh.dcn.fsdp=2", "--config.mesh.tensor=2", "--config.mesh.data=2"], "fsdp"),
    (["--config.mesh.dcn.pipeline=2", "--config.mesh.fsdp=4", "--config.mesh.data=1", *PIPELINED],
     "pipeline"),
])
def test_each_ici_group_of_a_hybrid_mesh_is_on_one_host(layout, dcn_axis):
    run = launch_two(None, *layout, module="tests.mesh_layout_probe")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    line = next(l for l in run.stdout.splitlines()
                if l.startswith(f"[0] hosts by {dcn_axis} index:"))
    # Each index along the DCN axis is one ICI group: all its devices on one host.
    assert json.loads(line.split(":", 1)[1]) == [[0], [1]]


@pytest.mark.slow
def test_the_slowest_host_is_named(tmp_path):
    # A second per step: far above what a busy test machine adds to either host's own time.
    run = launch_two(tmp_path / "run", "--config.mesh.data=-1",
                     env=fake_env(tmp_path, slow_host=(1, 1.0)))
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        lines = [r for r in map(json.loads, f) if "slowest_host" in r]
    assert lines and all(r["slowest_host"] == 1 for r in lines), lines
    assert all(r["host_time_max_s"] >= 1.0 for r in lines)  # the injected sleep is its own time
    assert "[0] warning: host 1 is slow" in run.stdout
