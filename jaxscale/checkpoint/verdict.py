"""What a failed read of a checkpoint proves, and every process agreeing on it.

A restore never renames or deletes a checkpoint because reading it failed once: each failure is
sorted by what it proves, and only proven damage sets a checkpoint aside.

* damaged, on positive evidence only. Before reading, the step folder is inspected (every read
  and stat raising its real error; see `reading.py`): its commit record (`_CHECKPOINT_METADATA`,
  given a commit time when the save finished) is missing or records no commit; an item's metadata
  file is missing or not JSON. While reading, the reader finds the array bytes wrong:
  TensorStore's OUT_OF_RANGE (a file shorter than its manifest records), DATA_LOSS, NOT_FOUND (a
  file it opened is gone) or FAILED_PRECONDITION (a stream that does not decode); of the errors
  from a failed system call, only ENOENT counts;
* unavailable: an OSError from the reader (EIO, EMFILE, ENOSPC, a timeout; FileNotFoundError too,
  which Orbax raises when `exists()` says False, as it does on any storage error), MemoryError, or
  a TensorStore error from a failed system call or an unanswered request (UNAVAILABLE,
  DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ...). Every process tries again after each of
  `RETRY_DELAYS_S`; then the run stops with TransientError (exit 75), every checkpoint where it
  was;
* usage: the storage refused this process (`storage.access_denied`: a permission, a read-only
  mount, gcsfs' HTTP 403/401, TensorStore's PERMISSION_DENIED or UNAUTHENTICATED), or the attempt
  raised a JaxscaleError of its own (a `restore_from` path that is no checkpoint). No retry
  helps: every process raises a JaxscaleError (exit 2) in the words of the first to fail;
* anything else is a bug, raised as it is.

Only the errors an error was raised from (`__cause__`) are its causes, never the one that was
being handled when it was raised (`__context__`): Orbax and jaxscale wrap with `raise ... from`,
and a KeyError raised while handling an OSError is a bug, not a storage failure.

Every process reaches the same verdict on each try (the gravest any process reached) before any
acts on it. The same sorting of causes tells a save that failed on storage from one that found
no space left, one the storage refused and a bug (`save_failure_kind`); the gravest outcome of a
save is made every process's by `jaxscale.runtime.agreement.gravest`.
"""

from __future__ import annotations

import enum
import errno
import json
import logging
import re
import time
from typing import Any, Callable, Iterator, NamedTuple

import jax

from jaxscale.errors import JaxscaleError, TransientError
from jaxscale.runtime.agreement import gravest
from jaxscale.runtime.storage import (
    access_denied,
    grant_or,
    library_errors,
    library_refused,
    no_space,
)

logger = logging.getLogger(__name__)

# Seconds to wait before each new try at reading a checkpoint the storage did not deliver; after
# the last try the run exits 75 for its launcher to retry with a longer backoff. Tests shorten it.
RETRY_DELAYS_S = (1.0, 4.0, 15.0)


class Verdict(enum.IntEnum):
    """How reading a checkpoint went, gravest last: processes take the gravest any reached."""
    OK = 0
    UNAVAILABLE = 1  # the storage did not deliver it: tried again, then exit 75
    DAMAGED = 2  # positive evidence that its files are wrong: skipped, set aside
    USAGE = 3  # the user must change something: JaxscaleError on every process, exit 2
    FAILED = 4  # an error that proves none of these (a bug): raised


class Outcome(NamedTuple):
    verdict: Verdict
    problem: str = ""  # what went wrong, one line; "" when OK
    value: Any = None  # what the attempt returned, when OK


class Damage(Exception):
    """Positive evidence, found by looking at a checkpoint's files, that it is damaged."""


class Unavailable(Exception):
    """The storage answered one read unlike the one before: no evidence, a failing storage."""


# TensorStore errors are ValueErrors whose message starts with an absl status code (but
# INVALID_ARGUMENT's). Of the codes, those that say the storage did not answer, and those that
# say what it answered is wrong (a byte range past the end of a file, a stream that does not
# decode, a file gone). A refusal (PERMISSION_DENIED, UNAUTHENTICATED) is `access_denied`'s.
_STATUS = re.compile(r"([A-Z_]+): ")
_UNAVAILABLE_STATUSES = frozenset({
    "UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED", "UNKNOWN",
    "INTERNAL"})
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
        error = error.__cause__


def read_verdict(error: BaseException) -> tuple[Verdict, str]:
    """What reading a checkpoint raising `error` proves, with the words of the error that
    decided it: the first of `error`'s causes that proves something."""
    for cause in _causes(error):
        verdict = _cause_verdict(cause)
        if verdict is not None:
            if verdict is Verdict.USAGE and not isinstance(cause, JaxscaleError):
                return verdict, f"{one_line(cause)}; {grant_or(_ELSEWHERE)}"
            # jaxscale's own findings are sentences; an error raised below is named by its type.
            found = isinstance(cause, (Damage, Unavailable, JaxscaleError, TransientError))
            return verdict, str(cause) if found else one_line(cause)
    return Verdict.FAILED, one_line(error)


# The other fix for a checkpoint folder the storage refuses to read, or to write.
_ELSEWHERE = "point checkpoint.dir (or checkpoint.restore_from) at a folder it may use"
_WRITABLE = "pass --config.checkpoint.dir=<a folder you can write>"


def _cause_verdict(error: BaseException) -> Verdict | None:
    if isinstance(error, Damage):
        return Verdict.DAMAGED
    if isinstance(error, JaxscaleError) or access_denied(error):
        return Verdict.USAGE
    if isinstance(error, TransientError):  # a check of jaxscale's own found the storage failing
        return Verdict.UNAVAILABLE
    # FileNotFoundError included: Orbax raises it when `exists()` says False, which
    # os.path.exists says on any storage error. Every file the reader checks that way, the
    # inspection (`reading.py`) has found (or proven missing) already. TimeoutError and
    # ConnectionError are OSErrors too.
    if isinstance(error, (OSError, MemoryError, Unavailable)):
        return Verdict.UNAVAILABLE
    if isinstance(error, library_errors()):  # gcsfs' HttpError: a bucket's 5xx once retried
        return Verdict.USAGE if library_refused(error) else Verdict.UNAVAILABLE
    if isinstance(error, (json.JSONDecodeError, UnicodeDecodeError)):
        return Verdict.DAMAGED
    found = _tensorstore_error(error)
    if found is None:
        return None
    if found.os_error:  # of the failed system calls, only "no such file" proves anything
        return Verdict.DAMAGED if found.no_such_file else Verdict.UNAVAILABLE
    if found.code in _UNAVAILABLE_STATUSES:
        return Verdict.UNAVAILABLE
    return Verdict.DAMAGED if found.code in _DAMAGE_STATUSES else None


class SaveFailure(enum.IntEnum):
    """How a save went, gravest last: processes take the gravest any reached."""
    NONE = 0
    ABORTED = 1  # stopped because another process's save failed (barrier.SaveAborted)
    STORAGE = 2  # the storage failed for now (EIO, a timeout): tried again at the next save
    # A file or folder written into is not there (a bucket answers 404 once the bucket itself is
    # gone): as STORAGE, but for a bucket that is gone (`Checkpoints` asks the server).
    MISSING = 3
    NO_SPACE = 4  # ENOSPC or EDQUOT: room must be made, which may take a person
    REFUSED = 5  # the storage refused this process (a permission): exit 2 at once
    BUG = 6  # no storage failure: raised


def save_failure_kind(error: BaseException) -> tuple[SaveFailure, str]:
    """What `error` says about a failed save, with the words of the cause that says it: the first
    of its causes that says the storage refused this process (REFUSED) or failed (an OSError,
    MemoryError, a bucket library's failed request, or a TensorStore error from a failed system
    call or an unanswered request: NO_SPACE when it says so, MISSING for a FileNotFoundError or
    TensorStore's NOT_FOUND, else STORAGE); BUG for anything else."""
    for cause in _causes(error):
        if access_denied(cause):
            return SaveFailure.REFUSED, one_line(cause)
        # gcsfs writes Orbax's other files (metadata, shardings) into a bucket: its HttpError
        # once its retries are spent (a 503 mid-save), which is no OSError.
        if isinstance(cause, library_errors()):
            return ((SaveFailure.REFUSED if library_refused(cause) else SaveFailure.STORAGE),
                    one_line(cause))
        found = _tensorstore_error(cause)
        # TensorStore's NOT_FOUND while writing: what it writes into is gone (a bucket answers
        # 404 once the bucket is deleted), as gcsfs' FileNotFoundError says for Orbax's other
        # files in the same save; which of the two a save raises first is the threads' race.
        written_into_is_gone = isinstance(cause, FileNotFoundError) or (
            found is not None and found.code == "NOT_FOUND")
        if written_into_is_gone:
            return SaveFailure.MISSING, one_line(cause)
        if isinstance(cause, (OSError, MemoryError)) or (
                found is not None and (found.os_error or found.code in _UNAVAILABLE_STATUSES)):
            return ((SaveFailure.NO_SPACE if no_space(cause) else SaveFailure.STORAGE),
                    one_line(cause))
    return SaveFailure.BUG, one_line(error)


def save_failure(error: BaseException, what: str) -> JaxscaleError | TransientError | None:
    """What to raise when `error` made `what` (a save) fail (see `save_failure_kind`); None for a
    bug."""
    kind, words = save_failure_kind(error)
    return None if kind is SaveFailure.BUG else save_error(kind, what, words)


def save_error(kind: SaveFailure, what: str, words: str) -> JaxscaleError | TransientError:
    """A JaxscaleError (exit 2) for a save the storage refused, else a TransientError (exit 75):
    "<what> (<words>)", with the fix for a refusal."""
    if kind is SaveFailure.REFUSED:
        return JaxscaleError(f"{what} ({words}); {grant_or(_WRITABLE)}")
    return TransientError(f"{what} ({words})")


# -- agreeing, retrying ----------------------------------------------------------------------

def agreed(attempt: Callable[[], Any]) -> Outcome:
    """Runs `attempt` (every process together) and agrees on how it went: the gravest verdict any
    process reached is everyone's, with the words of the first process that reached it. A usage
    verdict is raised on every process as a JaxscaleError in those words; an error that proves
    nothing about the checkpoint is raised again once every process knows."""
    error = None
    try:
        mine = Outcome(Verdict.OK, value=attempt())
    except Exception as e:  # noqa: BLE001 - every process must learn of it before any leaves
        # (else the others wait in the next collective); what is no storage verdict is re-raised.
        error, mine = e, Outcome(*read_verdict(e))
    verdict, problem = _agree(mine.verdict, mine.problem)
    if verdict is Verdict.FAILED:
        if mine.verdict is Verdict.FAILED:
            raise error
        raise RuntimeError(f"reading a checkpoint failed on another process: {problem}")
    if verdict is Verdict.USAGE:
        if jax.process_count() == 1 and isinstance(error, JaxscaleError):
            raise error  # its own words and type (a ConfigError stays one)
        raise JaxscaleError(problem) from error
    return Outcome(verdict, problem, mine.value if verdict is Verdict.OK else None)


def _agree(verdict: Verdict, problem: str) -> tuple[Verdict, str]:
    code, problem = gravest(verdict, problem)
    return Verdict(code), problem


def retrying(attempt: Callable[[], Outcome], what: str) -> Outcome:
    """`attempt()`, tried again after each of `RETRY_DELAYS_S` while its verdict is UNAVAILABLE;
    every process waits and tries together, the verdicts being agreed."""
    for delay in RETRY_DELAYS_S:
        outcome = attempt()
        if outcome.verdict is not Verdict.UNAVAILABLE:
            return outcome
        logger.warning("%s could not be read (%s); trying again in %gs", what, outcome.problem,
                       delay)
        time.sleep(delay)
    return attempt()


def raise_unless_ok(outcome: Outcome, what: str) -> None:
    """TransientError for an outcome the storage left UNAVAILABLE; JaxscaleError for DAMAGED."""
    if outcome.verdict is Verdict.UNAVAILABLE:
        tries = len(RETRY_DELAYS_S) + 1
        raise TransientError(
            f"{what} could not be read ({outcome.problem}; {tries} tries over "
            f"{sum(RETRY_DELAYS_S):g}s); every checkpoint was left where it was")
    if outcome.verdict is Verdict.DAMAGED:
        raise JaxscaleError(f"{what} is damaged ({outcome.problem})")


def one_line(error: BaseException) -> str:
    """`error` for a message: its type and words on one line, without TensorStore's spec."""
    text = " ".join(str(error).split())
    text = text.split(" [tensorstore_spec=")[0]  # TensorStore appends its whole spec as JSON
    if len(text) > 300:  # the reason (an errno's words) comes last, after the paths
        text = f"{text[:140]} ... {text[-150:]}"
    return f"{type(error).__name__}: {text}"
