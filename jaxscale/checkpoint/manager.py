"""A run's checkpoints: when to save, async multi-host saves, and restoring the newest good one.

One checkpoint is the folder `<checkpoint dir>/<step>/` with four Orbax items:

    params/  the parameters; every process writes the shards it holds
    train/   the rest of the TrainState: step, optimizer state, loss scale
    data/    iterator.json: the data iterator position of every process's row streams
    meta/    step, seed, config, productive seconds (for goodput)

The train step uses no random numbers: the seed, the step and the data position determine every
later step, so they are the run's whole RNG state.

Saving. Orbax writes a checkpoint into a temporary folder and renames it to `<step>` once every
process has finished, so a crash mid-save leaves the earlier checkpoints as they were (the
unfinished folder is removed at the next start), and deletes old checkpoints only after the new
one is complete. A save that fails on storage (an OSError such as ENOSPC or EIO, in the blocking
part or in the background, where it surfaces at the next save, `wait` or `close`) ends the run
with TransientError (exit 75): the checkpoints before it are intact.

Restoring never renames or deletes a checkpoint because reading it failed. Each failure is sorted
by what it proves:

* damaged, on positive evidence only. Before reading, the step folder is inspected (every read
  and stat raising its real error): its commit record (`_CHECKPOINT_METADATA`, given a commit time
  when the save finished) is missing or records no commit; an item's metadata file is missing or
  not JSON. While reading, the reader finds the array bytes wrong: TensorStore's OUT_OF_RANGE (a
  file shorter than its manifest records), DATA_LOSS, NOT_FOUND (a file it opened is gone) or
  FAILED_PRECONDITION (a stream that does not decode); of the errors from a failed system call,
  only ENOENT counts;
* unavailable: an OSError from the reader (EIO, EMFILE, ENOSPC, a timeout; FileNotFoundError too,
  which Orbax raises when `exists()` says False, as it does on any storage error), MemoryError, or
  a TensorStore error from a failed system call or an unanswered request (UNAVAILABLE,
  DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...). Every process tries again after each of
  `RETRY_DELAYS_S`; then the run stops with TransientError (exit 75), every checkpoint where it
  was. An older checkpoint is not used instead: the newer one is likely sound, and the run would
  later save its step again over it;
* anything else is a bug, raised as it is.

Every process reaches the same verdict on each checkpoint (ok, damaged or unavailable: the
gravest any process reached) before any acts on it. A damaged checkpoint is skipped for the one
before it; once one restores, the damaged ones after it are renamed `<step>.corrupt-<time>` with a
warning (a later save of the same step would collide with them). When every checkpoint is damaged
the run stops with a JaxscaleError (exit 2) naming them all and renames nothing, so that a person
can look at them.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import logging
import os
import re
import time
from typing import Any, Callable, Iterator, NamedTuple

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxscale.errors import ConfigError, JaxscaleError, TransientError
from jaxscale.hf.config import is_hf_folder
from jaxscale.hf.weights import load_params
from jaxscale.models import LlamaConfig
from jaxscale.state import TrainState
from jaxscale.workdir import check_writable, storage_error

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = "checkpoints"
_CORRUPT_SUFFIX = ".corrupt-"
# Orbax's record of a step folder, written when the save starts and given `commit_timestamp_nsecs`
# when it finishes (every Orbax version this package supports, local folders and buckets alike).
_COMMIT_RECORD = "_CHECKPOINT_METADATA"
# Seconds to wait before each new try at reading a checkpoint the storage did not deliver; after
# the last try the run exits 75 for its launcher to retry with a longer backoff. Tests shorten it.
RETRY_DELAYS_S = (1.0, 4.0, 15.0)


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
        if jax.process_index() == 0:
            _prove_writable(self.directory)
        keep = [ocp.checkpoint_managers.LatestN(self.options.keep)]
        if self.options.keep_every_steps:
            keep.append(ocp.checkpoint_managers.EveryNSteps(self.options.keep_every_steps))
        with self._storage_failures_are_transient(f"checkpoint folder {self.directory} could not "
                                                  "be opened for saving"):
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
        """Waits for the save in flight to be durable; TransientError if it failed on storage."""
        if self._manager is not None:
            with self._storage_failures_are_transient(self._save_failed()):
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
        with self._storage_failures_are_transient(self._save_failed()):
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
        """Blocks until the last save is durable; TransientError if it failed on storage."""
        if self._manager is not None:
            with self._storage_failures_are_transient(self._save_failed()):
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
    def _storage_failures_are_transient(self, what: str) -> Iterator[None]:
        """Raises TransientError("<what> (<the error>)") for an error that says the storage
        failed (see `_storage_cause`); any other error passes as it is."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - sorted by its causes; all but storage re-raised
            cause = _storage_cause(e)
            if cause is None:
                raise
            raise TransientError(f"{what} ({_one_line(cause)})") from e

    # -- restoring ---------------------------------------------------------------------------

    def restore_newest(self, abstract_state: TrainState) -> Restored | None:
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
        listing = _retrying(lambda: _finalized_steps(self.directory),
                            f"checkpoint folder {self.directory}")
        _raise_unless_ok(listing, f"checkpoint folder {self.directory}")
        damaged: dict[int, str] = {}
        for step in reversed(listing.value):
            path = self.directory / str(step)
            outcome = _retrying(
                lambda: _restore_once(self.directory, step, abstract_state, params_only=False),
                f"checkpoint {path}")
            if outcome.verdict is _Verdict.OK:
                self._set_aside(damaged, outcome.value.path)
                return outcome.value
            if outcome.verdict is not _Verdict.DAMAGED:
                _raise_unless_ok(outcome, f"checkpoint {path}")
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
        for step, problem in damaged.items():
            path = self.directory / str(step)
            target = path.parent / f"{step}{_CORRUPT_SUFFIX}{stamp}"
            renamed = _retrying(lambda: _agreed(lambda: _rename_on_process_0(path, target)),
                                f"checkpoint {path}")
            if renamed.verdict is not _Verdict.OK:
                raise TransientError(f"damaged checkpoint {path} could not be renamed "
                                     f"{target.name} ({renamed.problem}); nothing else was "
                                     "changed")
            logger.warning("checkpoint %s is damaged (%s): renamed %s; resumed from %s", path,
                           problem, target.name, restored)


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
    JaxscaleError when it is no checkpoint or a damaged one, TransientError when the storage does
    not deliver it."""
    if is_hf_folder(path):
        begin = time.perf_counter()
        params = load_params(path, model_config, abstract_state.params)
        return Restored(params=params, train=None, data_state=None, meta={"step": 0},
                        path=os.path.abspath(path), seconds=time.perf_counter() - begin)
    what = f"checkpoint.restore_from={path!r}"
    located = _retrying(lambda: _agreed(lambda: _locate(path)), what)
    _raise_unless_ok(located, what)
    directory, step = located.value
    if step is None:
        listing = _retrying(lambda: _finalized_steps(directory), what)
        _raise_unless_ok(listing, what)
        if not listing.value:
            raise JaxscaleError(f"{what}: {directory} holds no finished checkpoint (only folders "
                                "of saves that never finished); point it at another run")
        step = listing.value[-1]
    outcome = _retrying(lambda: _restore_once(directory, step, abstract_state,
                                              params_only=params_only), what)
    if outcome.verdict is _Verdict.DAMAGED:
        raise JaxscaleError(f"{what}: checkpoint {directory / str(step)} is damaged "
                            f"({outcome.problem}); point checkpoint.restore_from at another of "
                            "its checkpoints")
    _raise_unless_ok(outcome, what)
    return outcome.value


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
    kind = _kind(given)
    if kind is None:
        raise JaxscaleError(f"checkpoint.restore_from={path!r} does not exist; {hint}")
    if kind == "file":
        raise JaxscaleError(f"checkpoint.restore_from={path!r} is a file, not a checkpoint; {hint}")
    if _kind(given / CHECKPOINT_SUBDIR) == "dir":
        given = given / CHECKPOINT_SUBDIR
    if given.name.isdigit() and _kind(given / "params") == "dir":
        return given.parent, int(given.name)
    if saved_steps(given):
        return given, None
    raise JaxscaleError(f"checkpoint.restore_from={path!r} holds no jaxscale checkpoint; {hint}")


def _kind(path: epath.Path) -> str | None:
    """"dir", "file", or None when nothing is at `path`. Unlike `exists()` (os.path.exists says
    False whatever the error), a storage error propagates: a failing disk is no missing folder."""
    try:
        return "dir" if path.stat().is_directory else "file"
    except (FileNotFoundError, NotADirectoryError):
        return None


def _finalized_steps(directory: epath.Path) -> _Outcome:
    """The steps Orbax lists as complete in `directory`, oldest first ([] without the folder),
    agreed. Whether the folder is there is agreed first: Orbax's reader waits at a barrier that
    every process must reach, or none."""
    found = _agreed(lambda: _kind(directory) is not None)
    if found.verdict is not _Verdict.OK or not _all_processes_agree(found.value):
        return found._replace(value=[])
    with contextlib.ExitStack() as stack:
        return _agreed(lambda: list(stack.enter_context(_reader(directory)).all_steps()))


def _rename_on_process_0(source: epath.Path, target: epath.Path) -> None:
    if jax.process_index() == 0:
        source.rename(target)


# -- what a failure proves -------------------------------------------------------------------


class _Verdict(enum.IntEnum):
    """How reading a checkpoint went, gravest last: processes take the gravest any reached."""
    OK = 0
    UNAVAILABLE = 1  # the storage did not deliver it: tried again, then exit 75
    DAMAGED = 2  # positive evidence that its files are wrong: skipped, set aside
    FAILED = 3  # an error that proves neither (a bug): raised


class _Outcome(NamedTuple):
    verdict: _Verdict
    problem: str = ""  # what went wrong, one line; "" when OK
    value: Any = None  # what the attempt returned, when OK


class _Damage(Exception):
    """Positive evidence, found by looking at a checkpoint's files, that it is damaged."""


class _Unavailable(Exception):
    """The storage answered one read unlike the one before: no evidence, a failing storage."""


# TensorStore errors are ValueErrors whose message starts with an absl status code (but
# INVALID_ARGUMENT's). Of the codes, those that say the storage did not answer, and those that
# say what it answered is wrong (a byte range past the end of a file, a stream that does not
# decode, a file gone).
_STATUS = re.compile(r"([A-Z_]+): ")
_UNAVAILABLE_STATUSES = frozenset({
    "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED", "UNKNOWN",
    "INTERNAL", "UNAUTHENTICATED", "PERMISSION_DENIED"})
_DAMAGE_STATUSES = frozenset({"DATA_LOSS", "OUT_OF_RANGE", "FAILED_PRECONDITION", "NOT_FOUND"})
_STATUS_CODES = _UNAVAILABLE_STATUSES | _DAMAGE_STATUSES | {
    "INVALID_ARGUMENT", "ALREADY_EXISTS", "UNIMPLEMENTED"}
# How TensorStore marks an error from a failed system call, whatever status it then carries
# (EIO is UNKNOWN, ENOTCONN FAILED_PRECONDITION, EFBIG OUT_OF_RANGE): a payload with the errno
# (recent releases), or the words "[OS error: ...]" (older ones, where ENOENT alone is NOT_FOUND).
_OS_ERROR = re.compile(r"os_error_code='?(\d+)|\[OS error")


class _TensorStoreError(NamedTuple):
    code: str  # its status code: "UNAVAILABLE", "OUT_OF_RANGE", ...
    os_error: bool  # it reports a failed system call
    no_such_file: bool  # ... that found no such file (ENOENT)


def _tensorstore_error(error: BaseException) -> _TensorStoreError | None:
    """What a TensorStore error says; None for any other error."""
    if not isinstance(error, ValueError):
        return None
    text = str(error)
    status = _STATUS.match(text)
    if not status or status[1] not in _STATUS_CODES:
        return None
    os_error = _OS_ERROR.search(text)
    if os_error and os_error[1]:
        no_such_file = int(os_error[1]) == errno.ENOENT
    else:
        no_such_file = bool(os_error) and status[1] == "NOT_FOUND"
    return _TensorStoreError(status[1], bool(os_error), no_such_file)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error` and the errors it was raised from (Orbax wraps TensorStore's), outermost first."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _read_verdict(error: BaseException) -> tuple[_Verdict, str]:
    """What reading a checkpoint raising `error` proves, with the words of the error that
    decided it: the first of `error`'s causes that proves something."""
    for cause in _causes(error):
        verdict = _cause_verdict(cause)
        if verdict is not None:
            # jaxscale's own findings are sentences; an error raised below is named by its type.
            found = isinstance(cause, (_Damage, _Unavailable))
            return verdict, str(cause) if found else _one_line(cause)
    return _Verdict.FAILED, _one_line(error)


def _cause_verdict(error: BaseException) -> _Verdict | None:
    if isinstance(error, _Damage):
        return _Verdict.DAMAGED
    # FileNotFoundError included: Orbax raises it when `exists()` says False, which
    # os.path.exists says on any storage error. Every file the reader checks that way, `_inspect`
    # has found (or proven missing) already. TimeoutError and ConnectionError are OSErrors too.
    if isinstance(error, (OSError, MemoryError, _Unavailable)):
        return _Verdict.UNAVAILABLE
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
        return _Verdict.DAMAGED
    found = _tensorstore_error(error)
    if found is None:
        return None
    if found.os_error:  # of the failed system calls, only "no such file" proves anything
        return _Verdict.DAMAGED if found.no_such_file else _Verdict.UNAVAILABLE
    if found.code in _UNAVAILABLE_STATUSES:
        return _Verdict.UNAVAILABLE
    return _Verdict.DAMAGED if found.code in _DAMAGE_STATUSES else None


def _storage_cause(error: BaseException) -> BaseException | None:
    """The cause of `error` that says writing failed on storage, if one does: an OSError (ENOSPC,
    EIO, a timeout), MemoryError, or a TensorStore error from a failed system call or an
    unanswered request."""
    for cause in _causes(error):
        found = _tensorstore_error(cause)
        if isinstance(cause, (OSError, MemoryError)) or (
                found is not None and (found.os_error or found.code in _UNAVAILABLE_STATUSES)):
            return cause
    return None


# -- agreeing, retrying ----------------------------------------------------------------------

# Room for one process's problem in the gather that agrees on a verdict.
_PROBLEM_BYTES = 480


def _agreed(attempt: Callable[[], Any]) -> _Outcome:
    """Runs `attempt` (every process together) and agrees on how it went: the gravest verdict any
    process reached is everyone's, with the words of the first process that reached it. An
    error that proves nothing about the checkpoint is raised again once every process knows."""
    error = None
    try:
        mine = _Outcome(_Verdict.OK, value=attempt())
    except Exception as e:  # noqa: BLE001 - every process must learn of it before any leaves
        # (else the others wait in the next collective); what is no storage verdict is re-raised.
        error, mine = e, _Outcome(*_read_verdict(e))
    verdict, problem = _agree(mine.verdict, mine.problem)
    if verdict is _Verdict.FAILED:
        if mine.verdict is _Verdict.FAILED:
            raise error
        raise RuntimeError(f"reading a checkpoint failed on another process: {problem}")
    return _Outcome(verdict, problem, mine.value if verdict is _Verdict.OK else None)


def _agree(verdict: _Verdict, problem: str) -> tuple[_Verdict, str]:
    if jax.process_count() == 1:
        return verdict, problem
    mine = np.zeros(1 + _PROBLEM_BYTES, np.uint8)
    mine[0] = verdict
    words = problem.encode()[:_PROBLEM_BYTES]
    mine[1:1 + len(words)] = np.frombuffer(words, np.uint8)
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    gravest = int(everyone[:, 0].max())
    first = int(np.argmax(everyone[:, 0] == gravest))
    words = everyone[first, 1:].tobytes().rstrip(b"\0").decode(errors="replace")
    return _Verdict(gravest), (f"process {first}: {words}" if gravest else "")


def _retrying(attempt: Callable[[], _Outcome], what: str) -> _Outcome:
    """`attempt()`, tried again after each of `RETRY_DELAYS_S` while its verdict is UNAVAILABLE;
    every process waits and tries together, the verdicts being agreed."""
    for delay in RETRY_DELAYS_S:
        outcome = attempt()
        if outcome.verdict is not _Verdict.UNAVAILABLE:
            return outcome
        logger.warning("%s could not be read (%s); trying again in %gs", what, outcome.problem,
                       delay)
        time.sleep(delay)
    return attempt()


def _raise_unless_ok(outcome: _Outcome, what: str) -> None:
    """TransientError for an outcome the storage left UNAVAILABLE; JaxscaleError for DAMAGED."""
    if outcome.verdict is _Verdict.UNAVAILABLE:
        tries = len(RETRY_DELAYS_S) + 1
        raise TransientError(
            f"{what} could not be read ({outcome.problem}; {tries} tries over "
            f"{sum(RETRY_DELAYS_S):g}s); every checkpoint was left where it was")
    if outcome.verdict is _Verdict.DAMAGED:
        raise JaxscaleError(f"{what} is damaged ({outcome.problem})")


# -- reading one checkpoint ------------------------------------------------------------------


def _restore_once(directory: epath.Path, step: int, abstract_state: TrainState, *,
                  params_only: bool) -> _Outcome:
    """One agreed try at restoring checkpoint `step`: its files are inspected and its metadata
    read, then (once it is known to fit `abstract_state`) its items. Raises ConfigError when the
    checkpoint is sound but its shapes do not fit."""
    path = directory / str(step)
    begin = time.perf_counter()
    # Inspected apart, before the reader: its barrier must be reached by every process or none.
    inspected = _agreed(lambda: _inspect(path, params_only))
    if inspected.verdict is not _Verdict.OK:
        return inspected
    with contextlib.ExitStack() as stack:
        def read_metadata() -> tuple[ocp.CheckpointManager, Any]:
            reader = stack.enter_context(_reader(directory))
            saved = reader.item_metadata(step)
            if not saved["params"] or not (params_only or saved["train"]):
                # Orbax reads None when `exists()` says False, as it does on a storage error;
                # `_inspect` has just read the files.
                raise _Unavailable("Orbax read no array metadata, though _METADATA is there")
            return reader, saved
        found = _agreed(read_metadata)
        if found.verdict is not _Verdict.OK:
            return found
        reader, saved = found.value
        _check_fits(saved["params"].tree, abstract_state.params, "parameter", path)
        if not params_only:
            _check_fits(saved["train"].tree, _train_part(abstract_state), "train state entry",
                        path, cast_floats=True)
        read = _agreed(lambda: reader.restore(step, args=_restore_args(abstract_state,
                                                                         params_only)))
    if read.verdict is not _Verdict.OK:
        return read
    items = read.value
    return _Outcome(_Verdict.OK, value=Restored(
        params=items["params"], train=None if params_only else items["train"],
        data_state=None if params_only else items["data"], meta=items["meta"], path=str(path),
        seconds=time.perf_counter() - begin))


def _inspect(path: epath.Path, params_only: bool) -> None:
    """Raises _Damage with what proves checkpoint `path` damaged: its commit record missing, or
    saying the save never finished; an item's folder or metadata missing, or not JSON. A storage
    error reading them propagates as it is: it proves nothing. The arrays' bytes are checked by
    the reader itself, which needs them anyway (see `_cause_verdict`)."""
    record = _json_file(path, _COMMIT_RECORD)
    if not isinstance(record, dict) or record.get("commit_timestamp_nsecs") is None:
        raise _Damage(f"{_COMMIT_RECORD} records no commit: its save never finished")
    metadata = {"params": ["_METADATA"], "meta": ["metadata"], "train": ["_METADATA"],
                "data": [_DataStateHandler.FILENAME, _DataStateHandler.EARLIER_FILENAME]}
    for item in ("params", "meta") if params_only else metadata:
        names = [f"{item}/{name}" for name in metadata[item]]
        present = [name for name in names if _kind(path / name) == "file"]
        if not present:
            raise _Damage(f"{names[0]} is missing")
        _json_file(path, present[0])


def _json_file(path: epath.Path, name: str) -> Any:
    """The JSON in checkpoint `path`'s file `name`; _Damage when it is missing or not JSON."""
    try:
        return json.loads((path / name).read_bytes())
    except FileNotFoundError:  # from open(): its real errno, unlike exists()
        raise _Damage(f"{name} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _Damage(f"{name} is not JSON ({e})") from None


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
    EARLIER_FILENAME = "process_0.json"

    def __init__(self):
        super().__init__(self.FILENAME)

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> dict:
        # `_kind`, not `exists()`: a storage error must not send the reader to the earlier file.
        if _kind(directory / self.FILENAME) is None:
            return json.loads((directory / self.EARLIER_FILENAME).read_text())
        return super().restore(directory, item, args)


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
                               f"({e.strerror or e})",
                            "pass --config.checkpoint.dir=<a folder you can write>") from e


def _process_0_decides(answer: bool) -> bool:
    if jax.process_count() == 1:
        return answer
    return bool(multihost_utils.broadcast_one_to_all(np.bool_(answer)))


def _all_processes_agree(answer: bool) -> bool:
    if jax.process_count() == 1:
        return answer
    return bool(np.all(multihost_utils.process_allgather(np.bool_(answer))))


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = text.split(" [tensorstore_spec=")[0]  # TensorStore appends its whole spec as JSON
    if len(text) > 300:  # the reason (an errno's words) comes last, after the paths
        text = f"{text[:140]} ... {text[-150:]}"
    return f"{type(error).__name__}: {text}"
