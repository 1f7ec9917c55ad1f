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
from gcsfs.retry import HttpError

from jaxscale.checkpoint import Checkpoints
from jaxscale.checks import validate
from jaxscale.data import make_input
from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.trainer import Trainer
from jaxscale.training.bad_steps import BadSteps, TooManyBadSteps
from jaxscale.training.state import TrainState
from tests.helpers import random_batch, small_config

FSDP8 = dict(fsdp=8)
CUBE = dict(data=2, fsdp=2, tensor=2)


def make_config(**mesh):
    c = small_config(**mesh)
    c.checkpoint.compilation_cache = False  # nothing to gain in one process; saves writing it
    return c


def trained_state(trainer):
    """A state after one step, so the optimizer moments are not all zero."""
    batch = jax.device_put(random_batch(trainer.config), trainer.program.batch_sharding)
    state, _ = trainer.program.train_step(trainer.program.init_state(0), batch)
    return state


def save(config, workdir, step, state, data_state):
    with Checkpoints(config, str(workdir)) as checkpoints:
        checkpoints.save(step, state, data_state, {"step": step, "productive_seconds": 1.5})


def restored_state(restored):
    return TrainState(params=restored.params, **restored.train)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{mesh name: (workdir, host copy of the state, data position)}, each holding checkpoints
    at steps 1 and 2. One state, trained on fsdp8 (one train step compiled, not one per mesh),
    is saved from each mesh's own layout: what the tests restore is how each mesh wrote it."""
    runs = {}
    expected = None
    for name, mesh in (("fsdp8", FSDP8), ("cube", CUBE)):
        workdir = tmp_path_factory.mktemp(name)
        config = make_config(**mesh)
        trainer = Trainer(config, str(workdir))
        train_input = make_input(config, "train", trainer.program.batch_sharding)
        next(train_input)
        data_state = train_input.get_state()
        if expected is None:
            expected = jax.device_get(trained_state(trainer))
        state = jax.device_put(expected, trainer.program.state_shardings)
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
        restored = checkpoints.restore_newest(trainer.program.abstract_state)
    assert restored.path.endswith("/2")
    assert restored.data_state == json.loads(json.dumps(data_state))  # tuples come back as lists
    assert restored.meta == {"step": 2, "productive_seconds": 1.5}
    state = restored_state(restored)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), expected)
    shardings = jax.tree.map(lambda a: a.sharding, state)
    assert shardings == trainer.program.state_shardings


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
        restored = checkpoints.restore_newest(trainer.program.abstract_state)
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
            checkpoints.restore_newest(trainer.program.abstract_state)
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
            checkpoints.restore_newest(trainer.program.abstract_state)
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
        start = trainer.restore(
            checkpoints, make_input(config, "train", trainer.program.batch_sharding))
        assert start.own is None
        state, _ = trainer.start_state(start)
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
        restored = checkpoints.restore_newest(trainer.program.abstract_state)
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
        train_input = make_input(config, "train", trainer.program.batch_sharding)
        if message is None:
            restored = trainer.restore(checkpoints, train_input).restored
            assert restored.path == str(source / "checkpoints" / "2")
        else:
            with pytest.raises(ConfigError, match=message):
                trainer.restore(checkpoints, train_input)


def two_processes(monkeypatch, rows_of, run, me):
    """What `run()` returns (or raises) on process `me` of 2 when process 0's row of its one
    gather is that of `rows_of[0]()` and process 1's that of `rows_of[1]()` (faked: each row is
    first gathered alone, as if the other process had the same)."""
    from jax.experimental import multihost_utils

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    rows = []
    for process, make_row in enumerate(rows_of):
        monkeypatch.setattr(jax, "process_index", lambda process=process: process)
        monkeypatch.setattr(multihost_utils, "process_allgather",
                            lambda row: rows.append(row) or np.stack([row, row]))
        try:
            make_row()
        except (KeyError, JaxscaleError):  # what this process alone raises; only its row matters
            pass
    monkeypatch.setattr(jax, "process_index", lambda: me)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda row: np.stack(rows))
    return run()


def on_two_processes(monkeypatch, first, second, me=1):
    """How `agreed` ends on process `me` of 2 when process 0 ran `first` and process 1 `second`:
    the agreed outcome, or what process `me` raises."""
    from jaxscale.checkpoint import verdict

    runs = [lambda: verdict.agreed(first), lambda: verdict.agreed(second)]
    return two_processes(monkeypatch, runs, runs[me], me)


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
    # A refusal: the user's to fix (a service account without rights on the bucket).
    ("PERMISSION_DENIED: HTTP response code: 403 with body: gs://bucket/ckpt/4/params/d/1f",
     "USAGE"),
    (f"PERMISSION_DENIED: {READ}: Permission denied [os_error_code='13']", "USAGE"),
    ("UNAUTHENTICATED: HTTP response code: 401 with body: no credentials", "USAGE"),
])
def test_what_a_read_error_proves(message, verdict):
    from jaxscale.checkpoint.verdict import Verdict, read_verdict

    # As the reader raises it: Orbax wraps TensorStore's ValueError in a plain Exception.
    wrapped = Exception("Encountered error while reading array index")
    wrapped.__cause__ = ValueError(message)
    assert read_verdict(wrapped)[0] is Verdict[verdict]


REFUSALS = [
    PermissionError(errno.EACCES, "Permission denied", "/ckpt/4/_CHECKPOINT_METADATA"),
    OSError(errno.EPERM, "Operation not permitted", "/ckpt/4"),
    OSError(errno.EROFS, "Read-only file system", "/ckpt/4"),
    # gcsfs raises HTTP 403 and 401 so: no errno.
    OSError("Forbidden: https://storage.googleapis.com/bucket/ckpt/4/_CHECKPOINT_METADATA\n"
            "sa@project.iam.gserviceaccount.com does not have storage.objects.get access"),
    OSError("Unauthorized: https://storage.googleapis.com/bucket/ckpt/4"),
    ValueError("PERMISSION_DENIED: HTTP response code: 403 with body: gs://bucket/ckpt/4"),
    # gcsfs raises a 401 it cannot refresh credentials for as its HttpError, no OSError.
    HttpError({"code": 401, "message": "Anonymous caller does not have storage.objects.create"}),
]
FAILURES = [OSError(errno.EIO, "Input/output error"), TimeoutError("read timed out"),
            OSError("Service Unavailable: https://storage.googleapis.com/bucket/ckpt/4"),
            ValueError("UNAVAILABLE: HTTP response code: 503"),
            # gcsfs' error once its retries of a 503 or 429 are spent (writing Orbax's metadata
            # mid-save, seen in test_a_bucket_failing_mid_save_stops_the_run_as_transient).
            HttpError({"code": 503, "message": "Service Unavailable"}),
            HttpError({"code": 429, "message": "Too Many Requests"})]


@pytest.mark.parametrize("error", REFUSALS, ids=lambda e: str(e)[:20])
def test_a_refusal_by_the_storage_is_the_users_to_fix_in_reads_saves_and_the_workdir(error):
    from jaxscale.checkpoint.verdict import Verdict, read_verdict, save_failure
    from jaxscale.errors import TransientError
    from jaxscale.runtime.storage import storage_error

    wrapped = Exception("Encountered error while reading array index")
    wrapped.__cause__ = error
    verdict, problem = read_verdict(wrapped)
    assert verdict is Verdict.USAGE and "grant this process's user (or service account)" in problem
    assert isinstance(save_failure(wrapped, "checkpoint /ckpt/4 could not be written"),
                      JaxscaleError)
    assert not isinstance(save_failure(wrapped, "x"), TransientError)
    if isinstance(error, OSError):
        made = storage_error(error, "workdir '/w' cannot be written", "pass --workdir=<...>")
        assert isinstance(made, ConfigError) and "grant this process" in str(made)


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: str(e)[:20])
def test_a_storage_failure_is_transient_in_reads_saves_and_the_workdir(error):
    from jaxscale.checkpoint.verdict import Verdict, read_verdict, save_failure
    from jaxscale.errors import TransientError
    from jaxscale.runtime.storage import storage_error

    assert read_verdict(error)[0] is Verdict.UNAVAILABLE
    assert isinstance(save_failure(error, "checkpoint /ckpt/4 could not be written"),
                      TransientError)
    if isinstance(error, OSError):
        assert isinstance(storage_error(error, "workdir '/w' cannot be written", "fix"),
                          TransientError)


# What a save into a deleted bucket raises (fake-gcs-server, test_bucket_faults.py): gcsfs for
# Orbax's metadata, TensorStore for the arrays' files; either may come first.
MISSING = [FileNotFoundError("http://127.0.0.1:1/upload/storage/v1/b/gone/o?name=run%2F8%2Fmeta"),
           ValueError("NOT_FOUND: Error writing gs://gone/run/8/train/_sharding: Not Found "
                      "[http_response_body='{}'] [http_response_code='404']")]


@pytest.mark.parametrize("error", MISSING, ids=lambda e: type(e).__name__)
def test_a_save_into_a_folder_that_is_gone_is_missing_whichever_library_says_it(error):
    from jaxscale.checkpoint.verdict import SaveFailure, save_failure_kind

    wrapped = Exception("save failed")
    wrapped.__cause__ = error
    assert save_failure_kind(wrapped)[0] is SaveFailure.MISSING


def test_a_checkpoint_folder_the_bucket_refuses_is_exit_2_before_anything_is_saved(
        tmp_path, monkeypatch):
    from etils import epath

    config = make_config(**FSDP8)
    config.checkpoint.dir = str(tmp_path / "checkpoints")

    def forbidden(self, *args, **kwargs):  # as gcsfs raises HTTP 403
        raise OSError(f"Forbidden: {self}\nno storage.objects.create access")
    monkeypatch.setattr(type(epath.Path("/")), "mkdir", forbidden)
    with pytest.raises(ConfigError, match=r"checkpoint directory .* cannot be written \(Forbidden"
                                          r".*grant this process's user \(or service account\)"
                        ) as raised:
        Checkpoints(config, str(tmp_path)).open_for_saving()
    assert "\n" not in str(raised.value)  # one `error:` line
    assert not (tmp_path / "checkpoints").exists()


def test_a_usage_error_on_one_process_is_a_jaxscale_error_on_every_process(
        monkeypatch, tmp_path):
    """checkpoint.restore_from names a folder host 0 has and host 1 lacks: both raise one
    JaxscaleError in host 1's words (exit 2), neither a RuntimeError (a bug's exit 1)."""
    from jaxscale.checkpoint.restore_from import _locate

    here, nowhere = tmp_path / "run", str(tmp_path / "nowhere")
    (here / "checkpoints" / "1" / "params").mkdir(parents=True)
    for me in (0, 1):
        with pytest.raises(JaxscaleError, match=rf"^process 1: checkpoint.restore_from="
                                                rf"'{nowhere}' does not exist; point"):
            on_two_processes(monkeypatch, lambda: _locate(str(here)), lambda: _locate(nowhere),
                             me=me)
        monkeypatch.undo()


def test_a_usage_verdict_outranks_damage_and_a_bug_outranks_both(monkeypatch):
    from jaxscale.checkpoint.verdict import Damage

    with pytest.raises(JaxscaleError, match=r"^process 1: PermissionError: .*grant"):
        on_two_processes(monkeypatch, raises(Damage("meta/metadata is missing")),
                         raises(REFUSALS[0]), me=0)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match=r"failed on another process: process 0: KeyError"):
        on_two_processes(monkeypatch, raises(KeyError("leaf")), raises(REFUSALS[0]))


def test_a_bug_raised_while_handling_a_storage_error_is_raised_as_a_bug():
    from jaxscale.checkpoint.verdict import Verdict, agreed, read_verdict, save_failure

    def attempt():
        try:
            raise OSError(errno.EIO, "Input/output error")
        except OSError:
            return {}["leaf"]  # a bug of ours, raised with the OSError as its __context__

    with pytest.raises(KeyError) as raised:
        agreed(attempt)
    assert isinstance(raised.value.__context__, OSError)
    assert read_verdict(raised.value)[0] is Verdict.FAILED
    assert save_failure(raised.value, "checkpoint /ckpt/4 could not be written") is None


def test_processes_that_see_the_checkpoint_folder_differently_exit_75(
        monkeypatch, tmp_path):
    """Host 1 does not see the folder host 0 sees (a bucket not consistent yet): retried, then
    TransientError; never a run that starts from scratch over the checkpoints."""
    from jax.experimental import multihost_utils

    from jaxscale.checkpoint import verdict
    from jaxscale.errors import TransientError

    monkeypatch.setattr(verdict, "RETRY_DELAYS_S", (0.0,))
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def allgather(row):  # this process is 0, and sees the folder; process 1 does not
        row = np.asarray(row)
        return np.array([row, np.bool_(False)]) if row.dtype == np.bool_ else np.stack([row, row])
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    config = make_config(**FSDP8)
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    with pytest.raises(TransientError, match=r"checkpoints could not be read \(processes \[0\] "
                                             r"see the folder, processes \[1\] do not; 2 tries"):
        Checkpoints(config, str(tmp_path)).restore_newest(None)
    assert os.listdir(tmp_path / "checkpoints") == ["1"]


def test_a_failing_disk_under_restore_from_is_transient_not_no_checkpoint(
        tmp_path, monkeypatch):
    """`is_dir()` says False on EIO, which made a failing disk "no jaxscale checkpoint" (exit
    2); the real error says the storage is failing (exit 75), and nothing is renamed."""
    from etils import epath

    from jaxscale.checkpoint import restore_from, verdict
    from jaxscale.errors import TransientError

    monkeypatch.setattr(verdict, "RETRY_DELAYS_S", (0.0,))
    source = tmp_path / "run" / "checkpoints"
    (source / "1" / "params").mkdir(parents=True)
    failing = str(source / "1" / "params")
    path_class = type(epath.Path("/"))
    real_stat, real_is_dir = path_class.stat, path_class.is_dir

    def stat(self):
        if str(self) == failing:
            raise OSError(errno.EIO, "Input/output error", str(self))
        return real_stat(self)
    monkeypatch.setattr(path_class, "stat", stat)
    # As os.path.isdir answers for a path whose stat fails, whatever the error.
    monkeypatch.setattr(path_class, "is_dir",
                        lambda self: False if str(self) == failing else real_is_dir(self))
    with pytest.raises(TransientError, match=r"could not be read \(cannot list the checkpoints "
                                             r"in .* \(Input/output error\): the storage is"):
        restore_from(str(tmp_path / "run"), None, params_only=True, model_config=None)
    assert os.listdir(source) == ["1"]


def test_a_checkpoint_folder_process_0_cannot_write_stops_every_process_before_orbax(
        tmp_path, monkeypatch):
    from jaxscale.checkpoint import tier

    (tmp_path / "a_file").write_text("hello")
    config = make_config(**FSDP8)
    config.checkpoint.dir = str(tmp_path / "a_file" / "checkpoints")
    created = []
    monkeypatch.setattr(tier.ocp, "CheckpointManager", lambda *args, **kwargs: created.append(
        args))
    # Process 1 proves nothing: its row is that of an agreement it passes.
    rows_of = [Checkpoints(config, str(tmp_path)).open_for_saving,
               lambda: tier.agreed(lambda: None)]
    for me in (1, 0):
        with pytest.raises(JaxscaleError, match=r"^process 0: checkpoint directory .* cannot be "
                                                r"written .*pass --config.checkpoint.dir"):
            two_processes(monkeypatch, rows_of, Checkpoints(config, str(tmp_path)).open_for_saving,
                          me)
    assert created == []  # no process went on to Orbax's barriers
