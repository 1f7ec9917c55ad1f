"""A run's checkpoints: when to save, async multi-host saves, and restoring the newest good one
(or, with `restore_from`, another run's).

Saving. Orbax writes a checkpoint into a temporary folder and renames it to `<step>` once every
process has finished, so a crash mid-save leaves the earlier checkpoints as they were (the
unfinished folder is removed at the next start), and deletes old checkpoints only after the new
one is complete. A save that fails on storage (an OSError such as ENOSPC or EIO, in the blocking
part or in the background, where it surfaces at the next save, `wait` or `close`) ends the run
with TransientError (exit 75): the checkpoints before it are intact. A save the storage refuses
(a permission, a read-only mount, a bucket the account has no rights on) ends it with a
JaxscaleError (exit 2): no retry grants access.

Restoring reads one checkpoint at a time (`reading.py`) and never renames or deletes one because
reading it failed: each failure is sorted into damaged or unavailable (`verdict.py`), the same on
every process. When the storage does not deliver a checkpoint, the run stops with TransientError
(exit 75), every checkpoint where it was; when it refuses this process, with a JaxscaleError
(exit 2), renaming nothing. An older checkpoint is not used instead: the newer one is
likely sound, and the run would later save its step again over it. A damaged checkpoint is
skipped for the one before it; once one restores, the damaged ones after it are renamed
`<step>.corrupt-<time>` with a warning (a later save of the same step would collide with them).
When every checkpoint is damaged the run stops with a JaxscaleError (exit 2) naming them all and
renames nothing, so that a person can look at them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Iterator

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

from jaxscale.checkpoint.reading import (FP8_ITEM, ParamsOnly, Restored, State, finalized_steps,
                                         handler_registry, path_kind, restore_once, train_part)
from jaxscale.checkpoint.verdict import (Verdict, agreed, raise_unless_ok, retrying,
                                         save_failure)
from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.hf.config import is_hf_folder
from jaxscale.hf.weights import load_params
from jaxscale.models.llama import LlamaConfig
from jaxscale.models.spec import ModelSpec, create_model
from jaxscale.runtime.storage import reason, storage_error
from jaxscale.runtime.workdir import check_writable

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
_CORRUPT_SUFFIX = ".corrupt-"


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
        self._last_step: int | None = None  # the step of the newest save started, for errors
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
        left by a save that never finished (a crash, kill -9, a failed write) are removed."""
        if not self.enabled or self._manager is not None:
            return

        def prove_on_process_0() -> None:
            if jax.process_index() == 0:
                _prove_writable(self.directory)
        # Agreed before anyone creates the manager (whose barriers every process must reach): a
        # ConfigError on process 0 is a JaxscaleError on every process, a TransientError 75.
        proven = agreed(prove_on_process_0)
        if proven.verdict is not Verdict.OK:
            raise TransientError(proven.problem)
        keep = [ocp.checkpoint_managers.LatestN(self.options.keep)]
        if self.options.keep_every_steps:
            keep.append(ocp.checkpoint_managers.EveryNSteps(self.options.keep_every_steps))
        with self._storage_failures_are_sorted(f"checkpoint folder {self.directory} could not be "
                                               "opened for saving"):
            self._manager = ocp.CheckpointManager(
                self.directory, handler_registry=handler_registry(),
                options=ocp.CheckpointManagerOptions(
                    enable_async_checkpointing=self._async_save,
                    cleanup_tmp_directories=True,
                    preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(keep)))

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Waits for the save in flight to be durable; TransientError if it failed on storage."""
        if self._manager is not None:
            with self._storage_failures_are_sorted(self._save_failed()):
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

    def save(self, step: int, state: State, data_state: dict, meta: dict, *,
             finite: bool = True) -> bool:
        """Starts saving; returns once the state is copied off the devices, so training can go on
        (and donate the state's buffers) while the files are written. Waits first for the save
        before it.

        A step that was not `finite` is not saved: the save moves to the next step (`due` says
        so), and no checkpoint ever follows a non-finite step. Returns whether it saved.
        Raises TransientError when this save or the one before failed on storage.
        """
        if not finite:
            self._save_owed = True
            logger.warning("step %d was not finite: its checkpoint waits for a finite step", step)
            return False
        self.open_for_saving()
        begin = time.perf_counter()
        self.wait()  # Orbax would wait too; waiting here records the previous save's total time
        self._last_step = step
        with self._storage_failures_are_sorted(self._save_failed()):
            items = dict(params=ocp.args.StandardSave(state.params),
                         train=ocp.args.StandardSave(train_part(state)),
                         data=ocp.args.JsonSave(data_state),
                         meta=ocp.args.JsonSave(meta))
            if state.fp8 is not None:
                items[FP8_ITEM] = ocp.args.StandardSave(state.fp8)
            self._manager.save(step, force=True, args=ocp.args.Composite(**items))
        now = time.perf_counter()
        self._metrics["checkpoint_blocking_seconds"] = now - begin
        self._in_flight, self._last_save, self._save_owed = begin, time.monotonic(), False
        return True

    def wait(self) -> None:
        """Blocks until the last save is durable; TransientError if it failed on storage."""
        if self._manager is not None:
            with self._storage_failures_are_sorted(self._save_failed()):
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

    def _save_failed(self) -> str:
        return (f"checkpoint {self.directory / str(self._last_step)} could not be written; the "
                "checkpoints before it are intact and a restart resumes from the newest")

    @contextlib.contextmanager
    def _storage_failures_are_sorted(self, what: str) -> Iterator[None]:
        """Raises TransientError("<what> (<the error>)") for an error that says the storage
        failed, JaxscaleError for one that says it refused this process (see `save_failure`);
        any other error passes as it is."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - sorted by its causes; all but storage re-raised
            failure = save_failure(e, what)
            if failure is None:
                raise
            raise failure from e

    # -- restoring ---------------------------------------------------------------------------

    def restore_newest(self, abstract_state: State) -> Restored | None:
        """The newest checkpoint that restores, into `abstract_state`'s shapes and shardings.

        Reads only, but for damaged checkpoints newer than the one restored: they are renamed
        (see the module's docstring). Raises TransientError when the storage does not deliver a
        checkpoint, JaxscaleError when every checkpoint is damaged, and ConfigError when one does
        not fit the model config (the user's to resolve).
        """
        if not self.enabled:
            return None
        # Agreed, and before any process writes: a process that looked after another had created
        # the folder would open a reader (and its barriers) that the others do not.
        listing = retrying(lambda: finalized_steps(self.directory),
                           f"checkpoint folder {self.directory}")
        raise_unless_ok(listing, f"checkpoint folder {self.directory}")
        damaged: dict[int, str] = {}
        for step in reversed(listing.value):
            path = self.directory / str(step)
            outcome = retrying(
                lambda: restore_once(self.directory, step, abstract_state, params_only=False),
                f"checkpoint {path}")
            if outcome.verdict is Verdict.OK:
                self._set_aside(damaged, outcome.value.path)
                return outcome.value
            if outcome.verdict is not Verdict.DAMAGED:
                raise_unless_ok(outcome, f"checkpoint {path}")
            logger.warning("checkpoint %s is damaged (%s); trying the one before it", path,
                           outcome.problem)
            damaged[step] = outcome.problem
        if damaged:
            named = "; ".join(f"{step}: {problem}" for step, problem in damaged.items())
            raise JaxscaleError(
                f"every checkpoint in {self.directory} is damaged ({named}); none was renamed, so "
                "that you can inspect them: repair them, or move them away to start the run from "
                "scratch")
        return None

    def _set_aside(self, damaged: dict[int, str], restored: str) -> None:
        """Renames the damaged checkpoints `<step>.corrupt-<time>`, newer than the one `restored`:
        a later save of their step would collide with them."""
        stamp = int(time.time())
        done: list[str] = []  # what was renamed before a rename failed: "4 to 4.corrupt-<time>"
        for step, problem in damaged.items():
            path = self.directory / str(step)
            target = path.parent / f"{step}{_CORRUPT_SUFFIX}{stamp}"
            changed = (f"renamed before it: {', '.join(done)}" if done else
                       "nothing else was changed")
            try:
                renamed = retrying(lambda: agreed(lambda: _rename_on_process_0(path, target)),
                                   f"checkpoint {path}")
            except JaxscaleError as e:  # refused: the words agreed on every process, and ours
                raise JaxscaleError(f"damaged checkpoint {path} could not be renamed "
                                    f"{target.name} ({e}); {changed}") from e
            if renamed.verdict is not Verdict.OK:
                raise TransientError(f"damaged checkpoint {path} could not be renamed "
                                     f"{target.name} ({renamed.problem}); {changed}")
            done.append(f"{step} to {target.name}")
            logger.warning("checkpoint %s is damaged (%s): renamed %s; resumed from %s", path,
                           problem, target.name, restored)


def restore_from(path: str, abstract_state: State, *, params_only: bool,
                 model_config: LlamaConfig) -> Restored:
    """Another run's checkpoint (`checkpoint.restore_from`): a workdir, its checkpoint folder or
    one step folder; or a Hugging Face model folder, whose weights are the params (params only,
    whatever `params_only` says: it has nothing else). Nothing in it is written. Raises
    JaxscaleError when it is no checkpoint or a damaged one, TransientError when the storage does
    not deliver it."""
    if is_hf_folder(path):
        begin = time.perf_counter()
        params = load_params(path, model_config, abstract_state.params)
        return Restored(params=params, train=None, data_state=None, meta={"step": 0},
                        path=os.path.abspath(path), seconds=time.perf_counter() - begin)
    what = f"checkpoint.restore_from={path!r}"
    located = retrying(lambda: agreed(lambda: _locate(path)), what)
    raise_unless_ok(located, what)
    directory, step = located.value
    if step is None:
        listing = retrying(lambda: finalized_steps(directory), what)
        raise_unless_ok(listing, what)
        if not listing.value:
            raise JaxscaleError(f"{what}: {directory} holds no finished checkpoint (only folders "
                                "of saves that never finished); point it at another run")
        step = listing.value[-1]
    outcome = retrying(lambda: restore_once(directory, step, abstract_state,
                                            params_only=params_only), what)
    if outcome.verdict is Verdict.DAMAGED:
        raise JaxscaleError(f"{what}: checkpoint {directory / str(step)} is damaged "
                            f"({outcome.problem}); point checkpoint.restore_from at another of "
                            "its checkpoints")
    raise_unless_ok(outcome, what)
    return outcome.value


def restore_params(path: str, abstract_params: Any, model_config: LlamaConfig) -> Restored:
    """`restore_from` of the parameters alone, read into `abstract_params` (shapes, dtypes and
    shardings; with LoRA, the adapters or the base, whichever the caller wants)."""
    return restore_from(path, ParamsOnly(abstract_params), params_only=True,
                        model_config=model_config)


def lora_base(config: ml_collections.ConfigDict, spec: ModelSpec,
              abstract_frozen: Any) -> tuple[Any, str]:
    """(the frozen base that a LoRA run's adapters are trained on, what it is), laid out as
    `abstract_frozen` (shapes, dtypes, shardings): `checkpoint.restore_from`'s parameters (a
    Hugging Face folder or a run), else the init of `train.seed`. That init is made with the
    adapters, as the run made it: they draw from the same random stream as the base."""
    if config.checkpoint.restore_from:
        restored = restore_params(config.checkpoint.restore_from, abstract_frozen, spec.config)
        return restored.params, restored.path

    def init():
        params = nnx.to_pure_dict(nnx.state(create_model(spec.config, config.train.seed),
                                            nnx.Param))
        return jax.tree.map(lambda x, a: x.astype(a.dtype), spec.frozen(params), abstract_frozen)

    shardings = jax.tree.map(lambda a: a.sharding, abstract_frozen)
    return jax.jit(init, out_shardings=shardings)(), f"the init of train.seed={config.train.seed}"


def saved_steps(directory: str | epath.Path) -> list[int]:
    """The steps with a checkpoint (a step folder holding params) in `directory`, local or a
    bucket (gs://...), oldest first; [] when there is no such folder. A failing disk is no empty
    folder: TransientError (exit 75), or ConfigError when access is refused."""
    directory = epath.Path(directory)
    try:
        if path_kind(directory) != "dir":
            return []
        return sorted(int(p.name) for p in directory.iterdir()
                      if p.name.isdigit() and path_kind(p / "params") == "dir")
    except OSError as e:
        raise storage_error(e, f"cannot list the checkpoints in {directory} ({reason(e)})",
                            "check the storage, then run again") from e


def _locate(path: str) -> tuple[epath.Path, int | None]:
    """(checkpoint folder, step or None for the newest) for a `restore_from` path."""
    hint = ("point checkpoint.restore_from at a run's workdir, its checkpoints/ folder, one "
            "step folder in it, or a Hugging Face model folder")
    # Orbax needs absolute paths; a URL (gs://...) is absolute already.
    given = epath.Path(path if "://" in path else os.path.abspath(path))
    kind = path_kind(given)
    if kind is None:
        raise JaxscaleError(f"checkpoint.restore_from={path!r} does not exist; {hint}")
    if kind == "file":
        raise JaxscaleError(f"checkpoint.restore_from={path!r} is a file, not a checkpoint; {hint}")
    if path_kind(given / CHECKPOINT_SUBDIR) == "dir":
        given = given / CHECKPOINT_SUBDIR
    if given.name.isdigit() and path_kind(given / "params") == "dir":
        return given.parent, int(given.name)
    if saved_steps(given):
        return given, None
    raise JaxscaleError(f"checkpoint.restore_from={path!r} holds no jaxscale checkpoint; {hint}")


def _rename_on_process_0(source: epath.Path, target: epath.Path) -> None:
    if jax.process_index() == 0:
        source.rename(target)


def _prove_writable(directory: epath.Path) -> None:
    """Creates `directory` and writes a file in it, before anything is compiled: ConfigError
    when the user must change something, TransientError when the storage is failing."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise storage_error(e, f"checkpoint directory {str(directory)!r} cannot be written "
                               f"({reason(e)})",
                            "pass --config.checkpoint.dir=<a folder you can write>") from e


def _process_0_decides(answer: bool) -> bool:
    if jax.process_count() == 1:
        return answer
    return bool(multihost_utils.broadcast_one_to_all(np.bool_(answer)))
