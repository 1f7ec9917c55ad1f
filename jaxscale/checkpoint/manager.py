"""A run's checkpoints: when to save, async multi-host saves, and restoring the newest good one.

One checkpoint is the folder `<checkpoint dir>/<step>/` with four Orbax items:

    params/  the parameters; every process writes the shards it holds
    train/   the rest of the TrainState: step, optimizer state, loss scale
    data/    iterator.json: the data iterator position of every process's row streams
    meta/    step, seed, config, productive seconds (for goodput)

The train step uses no random numbers: the seed, the step and the data position determine every
later step, so they are the run's whole RNG state.

Orbax writes a checkpoint into a temporary folder and renames it to `<step>` once every process has
finished, so a crash mid-save leaves the earlier checkpoints as they were, and deletes old
checkpoints only after the new one is complete. A folder that is complete but damaged later
(a truncated or deleted file) fails to restore: it is renamed `<step>.corrupt-<time>` with a
warning and the checkpoint before it is used.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Any, NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.hf.config import is_hf_folder
from jaxscale.hf.weights import load_params
from jaxscale.models import LlamaConfig
from jaxscale.state import TrainState
from jaxscale.workdir import check_writable

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
_CORRUPT_SUFFIX = ".corrupt-"


class Restored(NamedTuple):
    params: Any
    train: dict | None  # the TrainState's other fields; None for a params-only restore
    data_state: dict | None  # every row stream's data position; None for params only
    meta: dict
    path: str
    seconds: float


def checkpoint_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    path = config.checkpoint.dir or os.path.join(workdir, CHECKPOINT_SUBDIR)
    # Orbax refuses relative paths; a URL (gs://...) is absolute already.
    return path if "://" in path else os.path.abspath(path)


class Checkpoints:
    """The checkpoints of one run, in `checkpoint_dir(config, workdir)`.

    With `checkpoint.enabled=False` the run has none: nothing is due, nothing restores.
    `async_save=False` makes every save synchronous (the benchmark's baseline).
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir: str, *, async_save: bool = True):
        self.options = config.checkpoint
        self.enabled = self.options.enabled
        self.directory = epath.Path(checkpoint_dir(config, workdir))
        self._async_save = async_save
        self._last_save = time.monotonic()
        self._save_owed = False
        self._in_flight: float | None = None  # perf_counter() when the unfinished save began
        self._metrics: dict[str, float] = {}
        # Created by `open_for_saving()`: until then nothing is written, so a run that fails its
        # start-up checks (a checkpoint that does not fit, say) leaves the folder as it was.
        self._manager: ocp.CheckpointManager | None = None

    def check_writable(self) -> None:
        """ConfigError unless the folder can be created and written; writes nothing."""
        if self.enabled and "://" not in str(self.directory):
            check_writable(str(self.directory), "checkpoint directory",
                           "pass --config.checkpoint.dir=<a folder you can write>")

    def open_for_saving(self) -> None:
        """Creates the folder (proving it writable) and the manager that saves; on start, folders
        left by a save that never finished (a crash, kill -9) are removed."""
        if not self.enabled or self._manager is not None:
            return
        if jax.process_index() == 0:
            _prove_writable(self.directory)
        keep = [ocp.checkpoint_managers.LatestN(self.options.keep)]
        if self.options.keep_every_steps:
            keep.append(ocp.checkpoint_managers.EveryNSteps(self.options.keep_every_steps))
        self._manager = ocp.CheckpointManager(
            self.directory, handler_registry=_handler_registry(),
            options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self._async_save,
                cleanup_tmp_directories=True,
                preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(keep)))

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Waits for the save in flight to be durable."""
        if self._manager is not None:
            self._manager.close()

    # -- saving ------------------------------------------------------------------------------

    def due(self, step: int, *, log_step: bool, final: bool = False) -> bool:
        """Whether `step` should be saved: the run's last step, `every_steps`, `every_minutes`, or
        a save postponed from a non-finite step.

        The clock is read on logging steps only, where process 0's answer is shared with the
        others: processes must agree, and a broadcast on every step would cost a sync each.
        """
        if not self.enabled:
            return False
        self._note_finished_save()
        every_steps, every_minutes = self.options.every_steps, self.options.every_minutes
        if final or self._save_owed or (every_steps and step % every_steps == 0):
            return True
        if every_minutes and log_step:
            return _process_0_decides(time.monotonic() - self._last_save >= 60 * every_minutes)
        return False

    def save(self, step: int, state: TrainState, data_state: dict, meta: dict, *,
             finite: bool = True) -> bool:
        """Starts saving; returns once the state is copied off the devices, so training can go on
        (and donate the state's buffers) while the files are written. Waits first for the save
        before it.

        A step that was not `finite` is not saved: the save moves to the next step (`due` says
        so), and no checkpoint ever follows a non-finite step. Returns whether it saved.
        """
        if not finite:
            self._save_owed = True
            logger.warning("step %d was not finite: its checkpoint waits for a finite step", step)
            return False
        self.open_for_saving()
        begin = time.perf_counter()
        self.wait()  # Orbax would wait too; waiting here records the previous save's total time
        self._manager.save(step, force=True, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            train=ocp.args.StandardSave(_train_part(state)),
            data=ocp.args.JsonSave(data_state),
            meta=ocp.args.JsonSave(meta)))
        now = time.perf_counter()
        self._metrics["checkpoint_blocking_seconds"] = now - begin
        self._in_flight, self._last_save, self._save_owed = begin, time.monotonic(), False
        return True

    def wait(self) -> None:
        """Blocks until the last save is durable."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._note_finished_save()

    def take_metrics(self) -> dict[str, float]:
        """Timings of saves since the last call: blocking part and total (start to durable)."""
        self._note_finished_save()
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _note_finished_save(self) -> None:
        if self._in_flight is not None and not (self._manager and
                                                self._manager.is_saving_in_progress()):
            self._metrics["checkpoint_seconds"] = time.perf_counter() - self._in_flight
            self._in_flight = None

    # -- restoring ---------------------------------------------------------------------------

    def restore_newest(self, abstract_state: TrainState) -> Restored | None:
        """The newest checkpoint that restores, into `abstract_state`'s shapes and shardings.

        Reads only (a damaged checkpoint excepted: it is set aside with a warning and the one
        before it tried); a checkpoint that does not fit the model config is the user's to
        resolve (ConfigError).
        """
        # Agreed, and before any process writes: a process that looked after another had created
        # the folder would open a reader (and its barriers) that the others do not.
        if not self.enabled or not _all_processes_agree(self.directory.exists()):
            return None
        with _reader(self.directory) as reader:
            steps = list(reversed(reader.all_steps()))
            for step in steps:
                restored, problem = _try_restore(reader, step, abstract_state, params_only=False)
                if restored is not None:
                    return restored
                self._set_aside(step, problem)
        if steps:
            raise JaxscaleError(
                f"none of the checkpoints {steps} in {self.directory} could be restored (each was "
                f"renamed *{_CORRUPT_SUFFIX}<time>); inspect them, or move them away to start "
                "the run from scratch")
        return None

    def _set_aside(self, step: int, problem: str) -> None:
        path = self.directory / str(step)
        logger.warning("checkpoint %s is incomplete or corrupt (%s); setting it aside and "
                       "resuming from the checkpoint before it", path, problem)
        if jax.process_index() == 0:
            path.rename(path.parent / f"{step}{_CORRUPT_SUFFIX}{int(time.time())}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"jaxscale_set_aside_{step}")


def _reader(directory: epath.Path) -> ocp.CheckpointManager:
    """A manager that only reads `directory`: it creates, cleans up and deletes nothing."""
    with _quiet_read_only_notice():
        return ocp.CheckpointManager(
            directory, handler_registry=_handler_registry(),
            options=ocp.CheckpointManagerOptions(read_only=True, create=False,
                                                 save_interval_steps=0))


@contextlib.contextmanager
def _quiet_read_only_notice():
    """Orbax warns that a read-only manager's folder "is read only" (it is, on purpose); every
    resume would print it."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")

    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(keep)
    try:
        yield
    finally:
        absl_logger.removeFilter(keep)


def restore_from(path: str, abstract_state: TrainState, *, params_only: bool,
                 model_config: LlamaConfig) -> Restored:
    """Another run's checkpoint (`checkpoint.restore_from`): a workdir, its checkpoint folder or
    one step folder; or a Hugging Face model folder, whose weights are the params (params only,
    whatever `params_only` says: it has nothing else). Nothing in it is written. Raises
    JaxscaleError when it is no checkpoint."""
    if is_hf_folder(path):
        begin = time.perf_counter()
        params = load_params(path, model_config, abstract_state.params)
        return Restored(params=params, train=None, data_state=None, meta={"step": 0},
                        path=os.path.abspath(path), seconds=time.perf_counter() - begin)
    directory, step = _locate(path)
    with _reader(directory) as manager:
        if step is None:
            step = manager.latest_step()
        restored, problem = _try_restore(manager, step, abstract_state, params_only=params_only)
    if restored is None:
        raise JaxscaleError(f"checkpoint.restore_from={path!r}: checkpoint {directory / str(step)} "
                            f"cannot be restored ({problem})")
    return restored


def saved_steps(directory: str | epath.Path) -> list[int]:
    """The steps with a checkpoint (a step folder holding params) in `directory`, local or a
    bucket (gs://...), oldest first; [] when there is no such folder."""
    directory = epath.Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and (p / "params").is_dir())


def _locate(path: str) -> tuple[epath.Path, int | None]:
    """(checkpoint folder, step or None for the newest) for a `restore_from` path."""
    hint = ("point checkpoint.restore_from at a run's workdir, its checkpoints/ folder, one "
            "step folder in it, or a Hugging Face model folder")
    # Orbax needs absolute paths; a URL (gs://...) is absolute already.
    given = epath.Path(path if "://" in path else os.path.abspath(path))
    if not given.exists():
        raise JaxscaleError(f"checkpoint.restore_from={path!r} does not exist; {hint}")
    if not given.is_dir():
        raise JaxscaleError(f"checkpoint.restore_from={path!r} is a file, not a checkpoint; {hint}")
    if (given / CHECKPOINT_SUBDIR).is_dir():
        given = given / CHECKPOINT_SUBDIR
    if given.name.isdigit() and (given / "params").is_dir():
        return given.parent, int(given.name)
    if saved_steps(given):
        return given, None
    raise JaxscaleError(f"checkpoint.restore_from={path!r} holds no jaxscale checkpoint; {hint}")


def _try_restore(manager: ocp.CheckpointManager, step: int, abstract_state: TrainState, *,
                 params_only: bool) -> tuple[Restored | None, str]:
    """(Restored, "") or (None, why the checkpoint is damaged), agreed by all processes.

    Raises ConfigError when the checkpoint is sound but its shapes do not fit `abstract_state`.
    """
    path = manager.directory / str(step)
    begin = time.perf_counter()
    problem = ""
    try:
        saved = manager.item_metadata(step)
        if not (saved["params"] and saved["train"]):
            problem = "its array metadata is missing"
    except Exception as e:  # noqa: BLE001 - failing to read it in any way means it is damaged
        problem = _one_line(e)
    if not _all_processes_agree(not problem):
        return None, problem or "its metadata failed to load on another process"
    _check_fits(saved["params"].tree, abstract_state.params, "parameter", path)
    if not params_only:
        _check_fits(saved["train"].tree, _train_part(abstract_state), "train state entry", path,
                    cast_floats=True)
    try:
        items = manager.restore(step, args=_restore_args(abstract_state, params_only))
    except Exception as e:  # noqa: BLE001 - as above
        problem = _one_line(e)
    if not _all_processes_agree(not problem):
        return None, problem or "it failed to restore on another process"
    return Restored(params=items["params"], train=None if params_only else items["train"],
                    data_state=None if params_only else items["data"], meta=items["meta"],
                    path=str(path), seconds=time.perf_counter() - begin), ""


def _restore_args(abstract_state: TrainState, params_only: bool) -> ocp.args.Composite:
    items = dict(params=ocp.args.StandardRestore(abstract_state.params),
                 meta=ocp.args.JsonRestore())
    if not params_only:
        items.update(train=ocp.args.StandardRestore(_train_part(abstract_state)),
                     data=ocp.args.JsonRestore())
    return ocp.args.Composite(**items)


def _check_fits(saved: Any, expected: Any, kind: str, path: epath.Path, *,
                cast_floats: bool = False) -> None:
    """Raises ConfigError naming the first entry whose shape or dtype differs, or that one side
    lacks. With `cast_floats`, floating-point entries may differ in dtype: Orbax casts them on
    restore (the optimizer moments, when `optim.moment_dtype` changed between starts)."""
    saved_leaves, expected_leaves = _leaves_by_name(saved), _leaves_by_name(expected)
    fix = ("resume with the config that wrote it, or train in a new workdir (with "
           "checkpoint.restore_from to start from it)")
    for name, want in expected_leaves.items():
        have = saved_leaves.get(name)
        if have is None:
            raise ConfigError(f"checkpoint {path} does not fit the model config: {kind} {name!r} "
                              f"is not in the checkpoint; {fix}")
        have_dtype, want_dtype = np.dtype(have.dtype), np.dtype(want.dtype)
        castable = cast_floats and all(jax.numpy.issubdtype(d, jax.numpy.floating)
                                       for d in (have_dtype, want_dtype))
        if tuple(have.shape) != tuple(want.shape) or (have_dtype != want_dtype and not castable):
            raise ConfigError(
                f"checkpoint {path} does not fit the model config: {kind} {name!r} is "
                f"{np.dtype(have.dtype).name}{list(have.shape)} in the checkpoint but "
                f"{np.dtype(want.dtype).name}{list(want.shape)} with this config; {fix}")
    extra = sorted(set(saved_leaves) - set(expected_leaves))
    if extra:
        raise ConfigError(f"checkpoint {path} does not fit the model config: it has {kind} "
                          f"{extra[0]!r}, which this config lacks; {fix}")


def _leaves_by_name(tree: Any) -> dict[str, Any]:
    """{'a/b/0/c': leaf}: the same names for a TrainState's NamedTuples and the dicts and lists
    Orbax reads back."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): leaf for p, leaf in leaves}


def _train_part(state: TrainState) -> dict:
    """Everything in a TrainState but the params, saved as the `train` item."""
    return {k: v for k, v in state._asdict().items() if k != "params"}


def _handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for item in ("params", "train"):
        registry.add(item, ocp.args.StandardSave)
        registry.add(item, ocp.args.StandardRestore)
    data_state = _DataStateHandler()
    registry.add("data", ocp.args.JsonSave, data_state)
    registry.add("data", ocp.args.JsonRestore, data_state)
    registry.add("meta", ocp.args.JsonSave)
    registry.add("meta", ocp.args.JsonRestore)
    return registry


class _DataStateHandler(ocp.handlers.JsonCheckpointHandler):
    """The data iterator's position: `Input.get_state()` already holds every process's row
    streams, so process 0 writes it once and every process reads that file. Checkpoints written
    before this layout have one identical `process_<i>.json` per process; they read
    `process_0.json`."""

    FILENAME = "iterator.json"
    _EARLIER_FILENAME = "process_0.json"

    def __init__(self):
        super().__init__(self.FILENAME)

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> dict:
        if not (directory / self.FILENAME).exists():
            return json.loads((directory / self._EARLIER_FILENAME).read_text())
        return super().restore(directory, item, args)


def _prove_writable(directory: epath.Path) -> None:
    """Creates `directory` and writes a file in it, before anything is compiled."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"checkpoint directory {str(directory)!r} cannot be written "
                          f"({e.strerror or e}); pass --config.checkpoint.dir=<a folder you can "
                          "write>") from e


def _process_0_decides(answer: bool) -> bool:
    if jax.process_count() == 1:
        return answer
    return bool(multihost_utils.broadcast_one_to_all(np.bool_(answer)))


def _all_processes_agree(answer: bool) -> bool:
    if jax.process_count() == 1:
        return answer
    return bool(np.all(multihost_utils.process_allgather(np.bool_(answer))))


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"
