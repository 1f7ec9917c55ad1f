"""Checkpoints in one process: round trips on and across meshes, damaged checkpoints, bad input,
the save schedule and retention, non-finite steps."""

import errno
import json
import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.bad_steps import BadSteps, TooManyBadSteps
from jaxscale.checkpoint import Checkpoints
from jaxscale.config import validate
from jaxscale.data import make_input
from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.state import TrainState
from jaxscale.trainer import Trainer
from tests.helpers import random_batch, small_config

FSDP8 = dict(fsdp=8)
CUBE = dict(data=2, fsdp=2, tensor=2)


def make_config(**mesh):
    c = small_config(**mesh)
    c.checkpoint.compilation_cache = False  # nothing to gain in one process; saves writing it
    return c


def trained_state(trainer):
    """A state after one step, so the optimizer moments are not all zero."""
    batch = jax.device_put(random_batch(trainer.config), trainer.batch_sharding)
    state, _ = trainer.train_step(trainer.init_state(0), batch)
    return state


def save(config, workdir, step, state, data_state):
    with Checkpoints(config, str(workdir)) as checkpoints:
        checkpoints.save(step, state, data_state, {"step": step, "productive_seconds": 1.5})


def restored_state(restored):
    return TrainState(params=restored.params, **restored.train)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{mesh name: (workdir, host copy of the state, data position)}, each holding checkpoints
    at steps 1 and 2."""
    runs = {}
    for name, mesh in (("fsdp8", FSDP8), ("cube", CUBE)):
        workdir = tmp_path_factory.mktemp(name)
        config = make_config(**mesh)
        trainer = Trainer(config, str(workdir))
        train_input = make_input(config, "train", trainer.batch_sharding)
        next(train_input)
        data_state = train_input.get_state()
        state = trained_state(trainer)
        expected = jax.device_get(state)
        save(config, workdir, 1, state, data_state)
        save(config, workdir, 2, state, data_state)
        runs[name] = (workdir, expected, data_state)
    return runs


@pytest.mark.parametrize("written_on, mesh, num_devices", [
    ("fsdp8", FSDP8, 8), ("cube", CUBE, 8),  # the same mesh
    ("fsdp8", CUBE, 8), ("cube", FSDP8, 8),  # another mesh
    ("cube", dict(fsdp=2), 2),  # fewer devices
])
def test_full_state_round_trips_onto_any_mesh(saved, tmp_path, written_on, mesh, num_devices):
    source, expected, data_state = saved[written_on]
    config = make_config(**mesh)
    config.checkpoint.dir = str(source / "checkpoints")
    trainer = Trainer(config, str(tmp_path), devices=jax.devices()[:num_devices])
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        restored = checkpoints.restore_newest(trainer.abstract_state)
    assert restored.path.endswith("/2")
    assert restored.data_state == json.loads(json.dumps(data_state))  # tuples come back as lists
    assert restored.meta == {"step": 2, "productive_seconds": 1.5}
    state = restored_state(restored)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), expected)
    shardings = jax.tree.map(lambda a: a.sharding, state)
    assert shardings == trainer.state_shardings


def damage(step_dir, how):
    params = step_dir / "params"
    files = sorted((p for p in params.rglob("*") if p.is_file() and p.parent.name == "d"),
                   key=lambda p: p.stat().st_size)
    if how == "truncate":
        with open(files[-1], "r+b") as f:
            f.truncate(files[-1].stat().st_size // 2)
    elif how == "delete":
        files[-1].unlink()
    else:
        (params / "_METADATA").unlink()


def copy_of(saved, name, workdir):
    shutil.copytree(saved[name][0] / "checkpoints", workdir / "checkpoints")


@pytest.mark.parametrize("how", ["truncate", "delete", "metadata"])
def test_damaged_newest_checkpoint_is_set_aside_with_a_warning(saved, tmp_path, caplog, how):
    copy_of(saved, "fsdp8", tmp_path)
    config = make_config(**FSDP8)
    trainer = Trainer(config, str(tmp_path))
    damage(tmp_path / "checkpoints" / "2", how)

    with caplog.at_level(logging.WARNING), Checkpoints(config, str(tmp_path)) as checkpoints:
        restored = checkpoints.restore_newest(trainer.abstract_state)
    assert restored.meta["step"] == 1
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert names[0] == "1" and names[1].startswith("2.corrupt-"), names
    assert any(f"checkpoint {tmp_path}/checkpoints/2 is damaged" in r.getMessage()
               and f"renamed {names[1]}" in r.getMessage() for r in caplog.records)


def test_a_run_with_only_damaged_checkpoints_stops_and_renames_none(saved, tmp_path):
    copy_of(saved, "fsdp8", tmp_path)
    config = make_config(**FSDP8)
    trainer = Trainer(config, str(tmp_path))
    damage(tmp_path / "checkpoints" / "1", "truncate")
    damage(tmp_path / "checkpoints" / "2", "delete")
    before = listing(tmp_path)
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        with pytest.raises(JaxscaleError, match=r"every checkpoint in .* is damaged \(2: .*; 1: "
                                                r".*\); none was renamed"):
            checkpoints.restore_newest(trainer.abstract_state)
    assert listing(tmp_path) == before


def listing(workdir):
    """Every file and folder of the checkpoints in `workdir`, with its modification time."""
    return sorted((str(p), p.stat().st_mtime_ns) for p in (workdir / "checkpoints").rglob("*"))


def test_a_checkpoint_that_does_not_fit_names_the_first_mismatching_parameter(saved, tmp_path):
    source = saved["fsdp8"][0]
    before = listing(source)
    config = make_config(**FSDP8)
    config.model.mlp_dim = 256
    config.checkpoint.dir = str(source / "checkpoints")
    trainer = Trainer(config, str(tmp_path))
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        with pytest.raises(ConfigError, match=r"parameter 'blocks/mlp/down' is "
                                              r"float32\[2, 128, 64\] in the checkpoint but "
                                              r"float32\[2, 256, 64\] with this config"):
            checkpoints.restore_newest(trainer.abstract_state)
    assert listing(source) == before


@pytest.mark.parametrize("target, message", [
    ("nowhere", "does not exist"),
    ("a_file", "is a file, not a checkpoint"),
    ("empty_dir", "holds no jaxscale checkpoint"),
])
def test_restore_from_something_that_is_no_checkpoint_is_an_error(tmp_path, target, message):
    (tmp_path / "a_file").write_text("hello")
    (tmp_path / "empty_dir").mkdir()
    config = make_config(**FSDP8)
    config.checkpoint.restore_from = str(tmp_path / target)
    with pytest.raises(JaxscaleError, match=message):
        Trainer(config, str(tmp_path / "run")).run()


@pytest.mark.parametrize("params_only", [False, True])
def test_a_new_run_starts_from_another_runs_checkpoint(saved, tmp_path, params_only):
    source, expected, _ = saved["cube"]
    before = listing(source)
    config = make_config(**FSDP8)
    config.checkpoint.update(restore_from=str(source / "checkpoints" / "1"),
                             restore_params_only=params_only)
    trainer = Trainer(config, str(tmp_path))
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        own, restored = trainer.restore(checkpoints, make_input(config, "train",
                                                                trainer.batch_sharding))
        assert own is None
        state, _ = trainer.start_state(restored, own)
    state = jax.device_get(state)
    jax.tree.map(np.testing.assert_array_equal, state.params, expected.params)
    if params_only:  # fine-tuning: step 0 and a fresh optimizer
        assert int(state.step) == 0
        assert not any(np.any(x) for x in jax.tree.leaves(state.opt_state))
    else:
        jax.tree.map(np.testing.assert_array_equal, state, expected)
    assert listing(source) == before


def test_an_unwritable_checkpoint_dir_is_an_error_before_anything_runs(tmp_path):
    (tmp_path / "a_file").write_text("hello")
    config = make_config(**FSDP8)
    config.checkpoint.dir = str(tmp_path / "a_file" / "checkpoints")
    with pytest.raises(ConfigError, match="checkpoint dir.* cannot be written: .* is a file"):
        Checkpoints(config, str(tmp_path)).check_writable()
    with pytest.raises(ConfigError, match="checkpoint directory .* cannot be written"):
        Checkpoints(config, str(tmp_path)).open_for_saving()


def test_saves_follow_every_steps_and_keep_the_newest_plus_every_kth(saved, tmp_path):
    config = make_config(**FSDP8)
    config.checkpoint.update(every_steps=2, keep=2, keep_every_steps=4)
    state = saved["fsdp8"][1]  # host arrays save the same way
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        for step in range(1, 13):
            if checkpoints.due(step, log_step=False):
                checkpoints.save(step, state, {}, {})
    assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints")) == [4, 8, 10, 12]


def test_time_based_saves_are_due_on_logging_steps_once_the_minutes_have_passed(tmp_path):
    config = make_config(**FSDP8)
    config.checkpoint.update(every_steps=0, every_minutes=0.001)
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        time.sleep(0.1)
        assert not checkpoints.due(7, log_step=False)
        assert checkpoints.due(8, log_step=True)


def test_a_non_finite_steps_save_moves_to_the_next_step_and_the_last_step_is_due(tmp_path):
    config = make_config(**FSDP8)
    config.checkpoint.update(every_steps=10)
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        assert not checkpoints.due(9, log_step=False)
        assert checkpoints.due(10, log_step=False)
        assert not checkpoints.save(10, None, {}, {}, finite=False)  # nothing written
        assert not (tmp_path / "checkpoints").exists()
        assert checkpoints.due(11, log_step=False)
        assert checkpoints.due(13, log_step=False, final=True)


def test_bad_steps_count_the_run_of_skipped_steps_and_stop_at_the_limit():
    bad_steps = BadSteps(max_in_a_row=3)
    for step, skipped in enumerate([0, 1, 1, 0, 1, 1], start=1):
        bad_steps.add(step, jnp.int32(skipped))
    assert bad_steps.settle() == 2
    bad_steps.add(7, jnp.int32(1))
    with pytest.raises(TooManyBadSteps, match=r"3 steps in a row \(from step 5\).* after step 4"):
        bad_steps.settle()


class PoisonedInput:
    """The trainer's input with NaN in the loss mask of the batches for `bad_steps`."""

    def __init__(self, inner, bad_steps):
        self.inner, self.bad_steps, self.step = inner, bad_steps, 0

    def __next__(self):
        batch = next(self.inner)
        self.step += 1
        if self.step in self.bad_steps:
            batch["loss_mask"] = batch["loss_mask"] * jnp.nan
        return batch

    def get_state(self):
        return self.inner.get_state()

    def set_state(self, state):
        self.inner.set_state(state)

    def skipped_records(self):
        return self.inner.skipped_records()

    def close(self):
        self.inner.close()


def poison(monkeypatch, bad_steps):
    import jaxscale.trainer

    make_input = jaxscale.trainer.make_input

    def poisoned(config, split, sharding):
        inner = make_input(config, split, sharding)
        return PoisonedInput(inner, bad_steps) if split == "train" else inner
    monkeypatch.setattr(jaxscale.trainer, "make_input", poisoned)


def nan_config(steps):
    config = make_config(**FSDP8)
    config.train.update(steps=steps, max_bad_steps=3, log_every=1)
    config.checkpoint.update(every_steps=1, keep=20)
    return config


def test_a_non_finite_step_is_skipped_counted_and_never_checkpointed(tmp_path, monkeypatch):
    poison(monkeypatch, bad_steps={3})
    logged = Trainer(nan_config(steps=5), str(tmp_path)).run()
    assert np.isfinite(logged["loss"])
    lines = read_metrics(tmp_path)
    assert [l["skipped_steps"] for l in lines] == [0, 0, 1, 0, 0]
    # Step 3's save moved to step 4.
    assert sorted(int(n) for n in os.listdir(tmp_path / "checkpoints")) == [1, 2, 4, 5]


def test_a_non_finite_last_step_is_not_reported_as_saved(tmp_path, monkeypatch, capsys):
    poison(monkeypatch, bad_steps={3})
    config = nan_config(steps=3)
    config.checkpoint.every_steps = 2
    Trainer(config, str(tmp_path)).run()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2"]
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.endswith("no checkpoint of the last step (not finite); the newest is from "
                            "step 2"), summary


def test_too_many_bad_steps_in_a_row_stop_the_run_and_keep_the_last_good_checkpoint(
        tmp_path, monkeypatch):
    poison(monkeypatch, bad_steps=set(range(3, 20)))
    config = nan_config(steps=10)
    trainer = Trainer(config, str(tmp_path))
    with pytest.raises(TooManyBadSteps, match=r"3 steps in a row \(from step 3\)"):
        trainer.run()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2"]
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        restored = checkpoints.restore_newest(trainer.abstract_state)
    assert int(restored.train["step"]) == 2
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(restored.params)))


def read_metrics(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [l for l in map(json.loads, lines) if "loss" in l]


def test_float16_with_dynamic_loss_scaling_trains_without_diverging(tmp_path):
    config = make_config(**FSDP8)
    config.precision.compute_dtype = "float16"
    config.precision.loss_scale_init = 2.0 ** 30  # too big on purpose: the first steps overflow
    config.train.update(steps=30, log_every=10)
    config.checkpoint.enabled = False
    Trainer(config, str(tmp_path)).run()
    lines = read_metrics(tmp_path)
    assert all(np.isfinite(l["loss"]) for l in lines)
    assert lines[-1]["loss"] < lines[0]["loss"] - 0.5
    assert lines[-1]["loss_scale"] >= 1
    # The scale really is dynamic: it was halved on the overflowing steps.
    assert lines[-1]["loss_scale"] < config.precision.loss_scale_init


@pytest.mark.parametrize("overrides, message", [
    (dict(keep=0), r"checkpoint.keep=0 must be >= 1"),
    (dict(every_minutes=-1.0), r"checkpoint.every_minutes=-1.0 must be >= 0"),
    (dict(every_steps=100, keep_every_steps=250), r"must be a multiple of checkpoint.every_steps"),
    (dict(restore_params_only=True), r"needs checkpoint.restore_from=PATH"),
])
def test_checkpoint_config_mistakes_name_the_key(overrides, message):
    config = make_config()
    config.checkpoint.update(overrides)
    with pytest.raises(ConfigError, match=message):
        validate(config, 1)


def test_max_bad_steps_must_be_positive():
    config = make_config()
    config.train.max_bad_steps = 0
    with pytest.raises(ConfigError, match=r"train.max_bad_steps=0 must be >= 1"):
        validate(config, 1)


@pytest.mark.parametrize("mlp_dim, message", [
    (128, None),  # the same model: restores
    (256, r"parameter 'blocks/mlp/down' is float32\[2, 128, 64\] in the checkpoint"),
])
def test_restore_from_a_relative_path(saved, tmp_path, monkeypatch, mlp_dim, message):
    source = saved["fsdp8"][0]
    monkeypatch.chdir(source.parent)
    config = make_config(**FSDP8)
    config.model.mlp_dim = mlp_dim
    config.checkpoint.restore_from = source.name  # relative to the working directory
    trainer = Trainer(config, str(tmp_path))
    with Checkpoints(config, str(tmp_path)) as checkpoints:
        train_input = make_input(config, "train", trainer.batch_sharding)
        if message is None:
            _, restored = trainer.restore(checkpoints, train_input)
            assert restored.path == str(source / "checkpoints" / "2")
        else:
            with pytest.raises(ConfigError, match=message):
                trainer.restore(checkpoints, train_input)


def on_two_processes(monkeypatch, first, second):
    """How `agreed` ends on process 1 of 2 (faked: the gather is two rows) when process 0 ran
    `first` and process 1 `second`: the agreed outcome, or what process 1 raises."""
    from jax.experimental import multihost_utils

    from jaxscale.checkpoint import verdict

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    rows = []

    def allgather(row):
        rows.append(row)
        return np.stack([rows[0], row])
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    try:
        verdict.agreed(first)  # process 0 gathers its own row twice: only its row matters here
    except KeyError:  # process 0's own bug, raised again on process 0
        pass
    return verdict.agreed(second)


def raises(error):
    def attempt():
        raise error
    return attempt


def test_every_process_takes_the_gravest_verdict_in_the_words_of_the_first_to_reach_it(
        monkeypatch):
    from jaxscale.checkpoint.verdict import Damage, Verdict

    eio = OSError(errno.EIO, "Input/output error")
    outcome = on_two_processes(monkeypatch, lambda: "restored", raises(eio))
    assert (outcome.verdict, outcome.value) == (Verdict.UNAVAILABLE, None)
    assert outcome.problem == "process 1: OSError: [Errno 5] Input/output error"

    monkeypatch.undo()
    outcome = on_two_processes(monkeypatch, raises(Damage("meta/metadata is missing")),
                               raises(eio))
    assert (outcome.verdict, outcome.problem) == (Verdict.DAMAGED,
                                                 "process 0: meta/metadata is missing")

    monkeypatch.undo()
    outcome = on_two_processes(monkeypatch, lambda: "mine", lambda: "yours")
    assert (outcome.verdict, outcome.problem, outcome.value) == (Verdict.OK, "", "yours")

    monkeypatch.undo()  # a bug on process 0 ends every process, none with a verdict
    with pytest.raises(RuntimeError, match=r"failed on another process: process 0: KeyError"):
        on_two_processes(monkeypatch, raises(KeyError("leaf")), lambda: "restored")


READ = 'Error reading "params/0" in OCDBT database at local file "/ckpt/4/params/"'


@pytest.mark.parametrize("message, verdict", [
    # TensorStore's words for a failed system call: recent releases attach the errno (EIO is
    # UNKNOWN, ENOTCONN, a dead FUSE mount, FAILED_PRECONDITION), older ones say "[OS error".
    (f"UNKNOWN: {READ}: Input/output error [os_error_code='5']", "UNAVAILABLE"),
    (f"FAILED_PRECONDITION: {READ}: Transport endpoint is not connected "
     "[os_error_code='107']", "UNAVAILABLE"),
    (f"FAILED_PRECONDITION: {READ} [OS error: Input/output error]", "UNAVAILABLE"),
    (f"NOT_FOUND: {READ}: No such file or directory [os_error_code='2']", "DAMAGED"),
    (f"NOT_FOUND: {READ} [OS error: No such file or directory]", "DAMAGED"),
    # An unanswered request.
    ("UNAVAILABLE: HTTP response code: 503", "UNAVAILABLE"),
    ("DEADLINE_EXCEEDED: Timed out reading gs://bucket/ckpt/4/params/d/1f", "UNAVAILABLE"),
    # Bytes that are there but wrong.
    (f"OUT_OF_RANGE: {READ}: Requested byte range [303344, 318544) is not valid for value of "
     "size 220768", "DAMAGED"),
    (f"FAILED_PRECONDITION: {READ}: Truncated Zstd-compressed stream", "DAMAGED"),
    (f"DATA_LOSS: {READ}: checksum mismatch", "DAMAGED"),
    # No storage error at all: a bug, raised.
    ("too many values to unpack (expected 2)", "FAILED"),
])
def test_what_a_read_error_proves(message, verdict):
    from jaxscale.checkpoint.verdict import Verdict, read_verdict

    # As the reader raises it: Orbax wraps TensorStore's ValueError in a plain Exception.
    wrapped = Exception("Encountered error while reading array index")
    wrapped.__cause__ = ValueError(message)
    assert read_verdict(wrapped)[0] is Verdict[verdict]
