"""One tier of a run's checkpoints: a folder of step folders, the Orbax manager that saves into
it, and the reads and renames of its checkpoints.

The persistent tier is `checkpoint.dir` (a local folder or a bucket): every process writes its
shards of the arrays and process 0 the rest; Orbax commits the step folder once every process has
written. With several processes their background threads meet at a `SaveBarrier`, so that a write
failing on one process stops the save on all of them (barrier.py).

The local tier is `checkpoint.local_dir` on each host (a RAM disk, a local SSD): each process
writes everything it holds into `<local_dir>/process_<i>/<layout>` with no other process taking
part, and reads it back alone (reading.py's process-local checkpoints). `<layout>` names the shards
the process holds (`process_layout`): a run on another mesh or process count finds no local
checkpoint of its own, never one whose shards it lacks.

A damaged checkpoint is set aside as `<step>.corrupt-<time>` (`set_aside`). On a local disk that
is a rename, atomic. A bucket renames by copying every object and deleting the originals, which a
crash can leave half done; there the verdict is a marker object of that name instead (holding the
problem), written in one request: the step is skipped by every later start, and its objects stay
for a person to inspect until the run opens the folder for saving, which removes them (and the
marker) because it will save that step again.

A save starts with `save` (the blocking part: the state copied off the devices) and ends in
`finish`, which waits for it and returns how it went, the same on every process (`SaveOutcome`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from typing import Iterator, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxscale.checkpoint.barrier import SaveBarrier, failure_behind
from jaxscale.checkpoint.reading import (
    State,
    finalized_steps,
    handler_registry,
    items_to_save,
    own_steps,
    path_kind,
    process_local_options,
    restore_once,
)
from jaxscale.checkpoint.verdict import (
    Outcome,
    SaveFailure,
    Verdict,
    agreed,
    raise_unless_ok,
    retrying,
    save_failure,
    save_failure_kind,
)
from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.runtime.agreement import announced, gravest
from jaxscale.runtime.storage import check_bucket, in_bucket, reason, storage_error

logger = logging.getLogger(__name__)

_CORRUPT_SUFFIX = ".corrupt-"
# A bucket's marker of a damaged step (`set_aside`): `<step>.corrupt-<time>`.
_MARKER = re.compile(rf"(\d+){re.escape(_CORRUPT_SUFFIX)}\d+")


class SaveOutcome(NamedTuple):
    """How the newest save of a tier went, agreed by every process."""
    failure: SaveFailure
    problem: str = ""  # "process <i>: <what failed>" (the first process with that failure)
    step: int | None = None
    error: BaseException | None = None  # this process's own error, raised when it is a bug


class Tier:
    """The checkpoints in `directory`: written by every process together, or with
    `process_local` by this process alone into a folder of its own. `label` names them in
    messages ("checkpoint", "local checkpoint"); `metrics_prefix` prefixes their timings."""

    def __init__(self, directory: epath.Path, *, process_local: bool, keep: int,
                 keep_every_steps: int = 0, async_save: bool = True, label: str = "checkpoint",
                 metrics_prefix: str = ""):
        self.directory = directory
        self.process_local = process_local
        self.label = label
        self._keep, self._keep_every_steps = keep, keep_every_steps
        self._async_save = async_save
        self._metrics_prefix = metrics_prefix
        self._manager: ocp.CheckpointManager | None = None
        self._barrier: SaveBarrier | None = None
        self._step: int | None = None  # the newest save started
        self._unsettled = False  # a save started whose outcome `finish` has not returned yet
        self._begun: float | None = None  # perf_counter() at the start of a save not yet timed
        self.metrics: dict[str, float] = {}
        # Steps whose damage a marker object records ({step: marker}), in a bucket (`steps`).
        self._markers: dict[int, epath.Path] = {}

    @property
    def in_bucket(self) -> bool:
        return in_bucket(str(self.directory))

    def path(self, step: int) -> epath.Path:
        return self.directory / str(step)

    @property
    def is_open(self) -> bool:
        """Whether `open_for_saving` has made the manager that saves."""
        return self._manager is not None

    # -- saving ------------------------------------------------------------------------------

    def open_for_saving(self) -> None:
        """Creates the folder (proving it writable) and the manager that saves into it; on
        start, folders left by a save that never finished are removed. Raises JaxscaleError when
        the folder cannot be written, TransientError when its storage fails: on every process
        alike."""
        if self._manager is not None:
            return

        def prove() -> None:
            if self.process_local or jax.process_index() == 0:
                _prove_writable(self.directory, self.label)
                self._remove_marked()
            if self.process_local:  # a manager of this process alone: no barrier to reach
                self._manager = self._make_manager()
        # Agreed before anyone creates a manager that waits at barriers every process must reach.
        proven = agreed(prove)
        if proven.verdict is not Verdict.OK:
            raise TransientError(proven.problem)
        if not self.process_local:
            with self._failures_are_sorted(f"{self.label} folder {self.directory} could not be "
                                           "opened for saving"):
                self._manager = self._make_manager()

    def _remove_marked(self) -> None:
        """Removes the damaged steps that markers record, and then their markers: the run saves
        those steps again, and Orbax saves no step that is there already."""
        for step, marker in self._markers.items():
            if path_kind(self.path(step)) is not None:
                self.path(step).rmtree()
            marker.unlink()
            logger.warning("%s %s, marked damaged by %s, removed: the run saves its step again",
                           self.label, self.path(step), marker.name)
        self._markers = {}

    def _make_manager(self) -> ocp.CheckpointManager:
        keep = [ocp.checkpoint_managers.LatestN(self._keep)]
        if self._keep_every_steps:
            keep.append(ocp.checkpoint_managers.EveryNSteps(self._keep_every_steps))
        options = dict(enable_async_checkpointing=self._async_save, cleanup_tmp_directories=True,
                       preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(keep))
        # Orbax (0.12) makes a save's item folders on a thread while the arrays are written, and an
        # array write may make a folder first. On a local disk the save then fails (FileExistsError
        # on two processes in test_stops_processes.py, and the other waited 600 s for the folder's
        # signal); in a bucket, where a folder exists once any object is under it, Orbax removes
        # the folder as unfinished, with the writes in it (chunks of a committed checkpoint went
        # missing in test_bucket_faults.py). So the folders are made before any write.
        async_options = dict(create_directories_asynchronously=False)
        if self.process_local:  # the folder is made already: Orbax makes none for one process
            logging.getLogger("absl").addFilter(_without_local_notice)
            options.update(multiprocessing_options=process_local_options(), create=False,
                           enable_per_process_directory_creation=True)
        elif jax.process_count() > 1:
            self._barrier = SaveBarrier()
            async_options.update(barrier_sync_fn=self._barrier)
        options.update(async_options=ocp.AsyncOptions(**async_options))
        return _Manager(self.directory, handler_registry=handler_registry(self.process_local),
                        options=ocp.CheckpointManagerOptions(**options))

    def save(self, step: int, state: State, data_state: dict, meta: dict) -> None:
        """Starts saving `step` (the save before it finished: `finish`); returns once the state
        is copied off the devices. Raises as `_failures_are_sorted` says when the blocking part
        fails; in a save of every process, announced to the others (`agreement.announced`),
        which exit at once with the same line."""
        self.open_for_saving()
        if self._barrier is not None:
            self._barrier.next_save()
        begin = time.perf_counter()
        self._step = step
        try:
            with self._failures_are_sorted(self.failed_to_write(step)):
                self._manager.save(step, force=True, args=items_to_save(
                    state, data_state, meta, process_local=self.process_local))
        except (TransientError, JaxscaleError) as e:
            if self.process_local:  # this process alone: `Checkpoints` agrees how it went
                raise
            # Past Orbax's barriers the others have gone on, into the next collective, which
            # this process never enters: they learn of it from the announcement.
            raise announced(e) from e
        self.metrics[f"{self._metrics_prefix}checkpoint_blocking_seconds"] = (
            time.perf_counter() - begin)
        self._begun, self._unsettled = begin, True

    def finish(self) -> SaveOutcome:
        """Waits until the save in flight is over and returns how it went, agreed: the gravest
        failure any process had, in its words. Every process calls it at the same points."""
        if not self._unsettled:
            return SaveOutcome(SaveFailure.NONE)
        error = None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - every process learns of it; a bug is re-raised
            error = e
        failure, problem = SaveFailure.NONE, ""
        if error is not None:
            own = failure_behind(error)
            failure, problem = ((SaveFailure.ABORTED, "stopped because another process's save "
                                 "failed") if own is None else save_failure_kind(own))
        failure, problem = gravest(failure, problem)
        if failure == SaveFailure.NONE:
            self.note_finished_save()
        self._begun, self._unsettled = None, False
        return SaveOutcome(SaveFailure(failure), problem, self._step, error)

    def note_finished_save(self) -> None:
        """Records the total time (start to durable) of a save that is over, without waiting."""
        if self._begun is not None and not self._manager.is_saving_in_progress():
            self.metrics[f"{self._metrics_prefix}checkpoint_seconds"] = (
                time.perf_counter() - self._begun)
            self._begun = None

    def close(self) -> None:
        """Waits for the save in flight on this process alone (for a run that is ending), and
        raises what `_failures_are_sorted` makes of its failure."""
        if self._manager is not None:
            with self._failures_are_sorted(self.failed_to_write(self._step)):
                self._manager.close()

    def failed_to_write(self, step: int | None) -> str:
        return (f"{self.label} {self.path(step)} could not be written; the checkpoints before it "
                "are intact and a restart resumes from the newest")

    def raise_if_bucket_gone(self) -> None:
        """Raises what a start raises for a missing bucket (ConfigError, exit 2) when this tier is
        in a bucket that is gone: a save that found no folder to write into (MISSING) cannot
        succeed again, and the checkpoints before it went with the bucket, so the run does not
        end as for a storage failing for now. Nothing for a folder on disk or a bucket there."""
        if self.in_bucket:
            check_bucket(str(self.directory),
                         "checkpoint.local_dir" if self.process_local else "checkpoint.dir")

    @contextlib.contextmanager
    def _failures_are_sorted(self, what: str) -> Iterator[None]:
        """Raises TransientError("<what> (<the error>)") for an error that says the storage
        failed, JaxscaleError for one that says it refused this process (see `save_failure`);
        any other error passes as it is."""
        try:
            yield
        except Exception as e:  # sorted by its causes; all but storage re-raised
            own = failure_behind(e)
            if own is not None and save_failure_kind(own)[0] is SaveFailure.MISSING:
                self.raise_if_bucket_gone()
            failure = (TransientError(f"{what} (another process's save failed)") if own is None
                       else save_failure(own, what))
            if failure is None:
                raise
            raise failure from e

    # -- restoring ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of this tier's checkpoints, oldest first: agreed for the persistent tier
        (TransientError when its storage does not answer); this process's own for the local
        tier, where a folder that cannot be listed holds nothing (with a warning)."""
        if not self.process_local:
            listing = retrying(lambda: finalized_steps(self.directory),
                               f"{self.label} folder {self.directory}")
            raise_unless_ok(listing, f"{self.label} folder {self.directory}")
            if not self.in_bucket:
                return listing.value
            markers = retrying(lambda: agreed(self._find_markers),
                               f"{self.label} folder {self.directory}")
            raise_unless_ok(markers, f"{self.label} folder {self.directory}")
            self._markers = markers.value
            return [step for step in listing.value if step not in self._markers]
        try:
            return own_steps(self.directory)
        except OSError as e:
            logger.warning("%s folder %s cannot be listed (%s); its checkpoints are not used",
                           self.label, self.directory, reason(e))
            return []

    def _find_markers(self) -> dict[int, epath.Path]:
        if path_kind(self.directory) is None:
            return {}
        return {int(found.group(1)): p for p in self.directory.iterdir()
                if (found := _MARKER.fullmatch(p.name))}

    def restore(self, step: int, abstract_state: State) -> Outcome:
        """Agreed tries at reading checkpoint `step` (see `verdict.retrying`)."""
        return retrying(lambda: restore_once(self.directory, step, abstract_state,
                                             params_only=False,
                                             process_local=self.process_local),
                        f"{self.label} {self.path(step)}")

    def set_aside(self, damaged: dict[int, str], restored: str | None) -> None:
        """Renames the `damaged` checkpoints `<step>.corrupt-<time>` (a later save of their step
        would collide with them), newer than the one `restored` (its folder; None: none did):
        process 0 for the persistent tier, each process its own copy for the local tier. In a
        bucket, writes a marker object of that name instead (see the module's docstring)."""
        stamp = int(time.time())
        renamed_or_marked = "marked" if self.in_bucket else "renamed"
        done: list[str] = []  # what was set aside before one failed: "4 to 4.corrupt-<time>"
        for step, problem in damaged.items():
            path = self.path(step)
            target = path.parent / f"{step}{_CORRUPT_SUFFIX}{stamp}"
            changed = (f"{renamed_or_marked} before it: {', '.join(done)}" if done else
                       "nothing else was changed")

            def rename() -> None:
                if self.in_bucket:
                    if jax.process_index() == 0:
                        target.write_text(f"{problem}\n")
                elif self.process_local or jax.process_index() == 0:
                    if not self.process_local or os.path.lexists(path):
                        path.rename(target)
            try:
                renamed = retrying(lambda: agreed(rename), f"{self.label} {path}")
            except JaxscaleError as e:  # refused: the words agreed on every process, and ours
                raise JaxscaleError(f"damaged {self.label} {path} could not be "
                                    f"{renamed_or_marked} {target.name} ({e}); {changed}") from e
            if renamed.verdict is not Verdict.OK:
                raise TransientError(f"damaged {self.label} {path} could not be "
                                     f"{renamed_or_marked} {target.name} ({renamed.problem}); "
                                     f"{changed}")
            done.append(f"{step} to {target.name}")
            if self.in_bucket:
                self._markers[step] = target
            logger.warning("%s %s is damaged (%s): %s %s; %s", self.label, path, problem,
                           renamed_or_marked, target.name,
                           f"resumed from {restored}" if restored else "starting from step 0")

    def remove(self, steps: list[int], why: str) -> None:
        """Removes this process's copies of local checkpoints `steps`, which no restart can use
        (`why` says so); one that cannot be removed is left, with a warning."""
        for step in steps:
            try:
                self.path(step).rmtree()
                logger.warning("%s %s removed: %s", self.label, self.path(step), why)
            except OSError as e:
                logger.warning("%s %s could not be removed (%s): %s", self.label,
                               self.path(step), reason(e), why)


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, kept off JAX's preemption sync point, which the trainer alone asks
    (signals.py). Orbax asks it too, at each save and from the thread that finalizes a save, with
    the step of that save: JAX records the step of the latest caller, so a save finalized while the
    trainer was already a step further set every process's counter back, the sync point (1 + the
    highest counter) fell on a step the trainers had passed, and the SIGTERM was ignored (or, when
    only some had passed it, the others stopped alone: mismatched collectives). The trainer saves
    the agreed step itself; Orbax's answer only labelled its own statistics."""

    def reached_preemption(self, step: int) -> bool:
        return False


def _without_local_notice(record: logging.LogRecord) -> bool:
    """Drops the warning Orbax logs at every save of a process saving alone (as the local tier
    does on purpose): that it measures no global size."""
    return not record.getMessage().startswith("Global object size logging disabled")


def _prove_writable(directory: epath.Path, label: str) -> None:
    """Creates `directory` and writes a file in it, before anything is compiled: ConfigError
    when the user must change something, TransientError when the storage is failing."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_probe_{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        key = "local_dir" if label.startswith("local") else "dir"
        raise storage_error(e, f"{label} directory {str(directory)!r} cannot be written "
                               f"({reason(e)})",
                            f"pass --config.checkpoint.{key}=<a folder you can write>") from e
