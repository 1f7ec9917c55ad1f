"""Two tiers of checkpoints in one process: which checkpoint a restart takes (the agreement, with
a stand-in for the allgather of every process's local steps), a resume from the local tier
against an uninterrupted run, the persistent tier winning when it is newer, and a local folder
on a full disk. With several processes: test_checkpoint_tiers_processes.py."""

import errno
import json
import logging
import os
import shutil

import numpy as np
import pytest

from jaxscale.checkpoint import LOCAL, PERSISTENT
from jaxscale.checkpoint.manager import MOVED, restore_order, steps_everyone_holds
from jaxscale.config import check_settings
from jaxscale.errors import ConfigError
from tests.helpers import mesh_trainer, small_config
from tests.test_faults_checkpoint import failing, merged_losses, writing

STEPS = 6


def fake_gather(*others):
    """An allgather of every process's row of steps: this process's, then `others`' (their
    steps, padded with -1 as `steps_everyone_holds` pads its own)."""
    def gather(row):
        rows = [row]
        for steps in others:
            other = np.full_like(row, -1)
            other[:len(steps)] = steps
            rows.append(other)
        return np.stack(rows)
    return gather


def test_a_restart_takes_the_newest_step_every_process_holds():
    # Every process holds local 4 and 6; the persistent tier has 5: local 6, then 5, then 4.
    assert steps_everyone_holds([4, 6], fake_gather([4, 6], [6, 4])) == ([4, 6], [])
    assert restore_order([4, 6], [5]) == [(6, LOCAL), (5, PERSISTENT), (4, LOCAL)]
    # Process 1's host was replaced (an empty local folder): the persistent tier, and this
    # process's local steps are ones no start can use.
    assert steps_everyone_holds([4, 6], fake_gather([])) == ([], [4, 6])
    # Process 1 was killed while saving 6 locally: 4 is the newest local step all hold, but the
    # persistent 5 is newer.
    assert steps_everyone_holds([4, 6], fake_gather([4])) == ([4], [6])
    assert restore_order([4], [5]) == [(5, PERSISTENT), (4, LOCAL)]
    # A step in both tiers is read from the local one first.
    assert restore_order([6], [3, 6]) == [(6, LOCAL), (6, PERSISTENT), (3, PERSISTENT)]
    # A restart on another process count: its own layout has no local step yet; the old
    # layout's 7, held whole by every survivor, is newer than the persistent 4, and read before
    # a persistent copy of the same step.
    assert restore_order([], [4, 7], [5, 7]) == [(7, MOVED), (7, PERSISTENT), (5, MOVED),
                                                 (4, PERSISTENT)]
    assert restore_order([8], [7], [8]) == [(8, LOCAL), (8, MOVED), (7, PERSISTENT)]
    # Only each process's newest 64 steps take part (local_keep is at most 32).
    everyone, lacked = steps_everyone_holds(range(100), fake_gather(range(36, 100)))
    assert everyone == list(range(36, 100)) and lacked == []


def config_for(steps, workdir, **checkpoint):
    """`small_config` on 2 devices, a persistent checkpoint every 4 steps and a local one on the
    others, and a constant learning rate after one warmup step, so that a run stopped early and
    resumed takes the steps of a run of `steps`."""
    config = small_config(fsdp=2)
    config.train.steps = steps
    config.optim.min_lr_ratio = 1.0
    config.checkpoint.update(every_steps=4, local_every_steps=1, local_keep=2,
                             local_dir=str(workdir / "local"), compilation_cache=False)
    config.checkpoint.update(**checkpoint)
    return config


def run(workdir, steps, **checkpoint):
    return mesh_trainer(config_for(steps, workdir, **checkpoint), workdir).run()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The losses of a run of STEPS steps that nothing interrupted, with no local tier."""
    workdir = tmp_path_factory.mktemp("straight")
    run(workdir, STEPS, local_dir="", local_every_steps=0)
    return merged_losses(workdir)


def local_steps(workdir):
    """{layout folder: its complete local steps} of process 0."""
    root = workdir / "local" / "process_0"
    return {layout: sorted(int(n) for n in os.listdir(root / layout) if n.isdigit())
            for layout in os.listdir(root)}


@pytest.mark.slow
def test_a_restart_resumes_from_the_newest_tier_exactly(straight, tmp_path, capsys):
    workdir = tmp_path / "run"
    run(workdir, STEPS)  # persistent 4 and 6, local 1 2 3 5 (the newest 2 kept)
    ((layout, steps),) = local_steps(workdir).items()
    assert steps == [3, 5]
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]
    capsys.readouterr()

    # The node lost its last persistent save: the local 5 is newer than the persistent 4.
    shutil.rmtree(workdir / "checkpoints" / "6")
    run(workdir, STEPS)
    assert f"restored {workdir}/local/process_0/{layout}/5 " in capsys.readouterr().out
    assert merged_losses(workdir) == straight  # step 6 again, bitwise the same loss

    # Longer: the persistent 6 is newer than the local 5.
    run(workdir, STEPS + 2)
    assert f"restored {workdir}/checkpoints/6 " in capsys.readouterr().out


@pytest.mark.slow  # two runs on two layouts (about 12 s)
def test_local_checkpoints_of_another_layout_are_named_where_a_start_cannot_use_them(
        tmp_path, capsys):
    workdir = tmp_path / "run"
    run(workdir, 3)  # persistent 3, local 1 2 (on fsdp=2)
    ((layout, steps),) = local_steps(workdir).items()
    assert steps == [1, 2]
    # One process holds both devices' shards: every array whole, which a start on another
    # layout could restore (tests/test_elastic_local_restore.py). Fabricated: the record of a
    # process that held only its part, as each does under fsdp across processes.
    record = workdir / "local" / "process_0" / layout / "layout.json"
    assert json.loads(record.read_text()) == {"whole_arrays": True}
    record.write_text(json.dumps({"whole_arrays": False}))
    # The earlier start was killed before its persistent save; this one runs on data=2, where
    # each process holds other shards than the fsdp=2 folder has.
    shutil.rmtree(workdir / "checkpoints")
    capsys.readouterr()
    config = config_for(3, workdir)
    config.mesh.update(fsdp=1, data=2)
    mesh_trainer(config, workdir).run()
    out = capsys.readouterr().out
    assert "no checkpoint to resume from" not in out
    assert (f"local checkpoint {workdir}/local/process_0/{layout}/2 is not used: another layout "
            "of the state (mesh, sharding or process count) saved it") in out
    assert "starting from step 0 (the earlier files are in " in out


def test_a_full_local_disk_keeps_training_saves_remotely_and_warns_once(
        tmp_path, monkeypatch, caplog):
    """(Its losses equal an uninterrupted run's with several processes:
    test_checkpoint_tiers_processes.py.)"""
    workdir = tmp_path / "run"
    # Every write of a local save fails: the disk filled after the run started.
    failed = failing(monkeypatch, "open", errno.ENOSPC, lambda path, mode="r": writing(mode) and (
        path.startswith(f"{workdir}/local/") and ".orbax-checkpoint-tmp" in path))
    with caplog.at_level(logging.WARNING, "jaxscale"):
        run(workdir, STEPS)
    assert failed
    warnings = [r.getMessage() for r in caplog.records if "local checkpoints are off" in
                r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("the local checkpoint of step 1 could not be written (OSError")
    assert f"{workdir}/local/process_0/" in warnings[0]
    assert "No space left on device" in warnings[0]
    assert warnings[0].endswith(f"checkpoints go to {workdir}/checkpoints only")
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "6"]
    assert all(steps == [] for steps in local_steps(workdir).values())
    assert sorted(merged_losses(workdir)) == list(range(1, STEPS + 1))


def test_saves_of_both_tiers_leave_jaxs_preemption_sync_point_to_the_trainer(
        tmp_path, monkeypatch):
    """Orbax asks JAX's sync point at each save and again from the thread that finalizes it, with
    the step of that save; a count set back so made the sync point fall on a step the trainers
    had passed, and a SIGTERM was ignored (signals.py). Here no save may ask it."""
    from jax.experimental import multihost_utils

    asked = []
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda step: asked.append(step) or False)
    run(tmp_path / "run", 3)  # local 1 and 2, then persistent 3 (the last step)
    assert asked == []


@pytest.mark.parametrize("key, value, words", [
    ("local_dir", "gs://bucket/local", "is a URL; the local tier is a folder on each host"),
    ("local_every_steps", 10, "needs checkpoint.local_dir"),
    ("local_keep", 33, "must be in [1, 32]"),
])
def test_local_tier_keys_are_checked(key, value, words):
    config = small_config()
    config.checkpoint[key] = value
    with pytest.raises(ConfigError, match=rf"^checkpoint\.{key}={value!r}.*" + words.replace(
            "[", r"\[").replace("]", r"\]")):
        check_settings(config)


@pytest.mark.parametrize("process_local", [False, True])
def test_every_tier_makes_a_saves_folders_before_any_array_is_written(tmp_path, process_local):
    """Orbax's default makes them on a thread while the arrays are written, and a write that
    makes a folder first failed a two-process save on a local disk (FileExistsError) and lost
    chunks in a bucket (jaxscale/checkpoint/tier.py)."""
    from etils import epath

    from jaxscale.checkpoint.tier import Tier

    directory = epath.Path(tmp_path / "tier")
    directory.mkdir()
    manager = Tier(directory, process_local=process_local, keep=1)._make_manager()
    try:
        assert manager._options.async_options.create_directories_asynchronously is False
    finally:
        manager.close()
