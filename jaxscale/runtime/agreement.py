"""Where the processes of a run agree: every exchange of host values between them is here.

A multi-process run goes wrong when processes act on different answers: one saves a step the
others skip, one restores what another cannot read, one stops while the others wait in the next
collective until the heartbeat timeout. Each answer that must be the same everywhere is made the
same here, by one collective every process calls at the same point of its program:

* `gathered(row)`: every process's small array, in process order (the primitive the rest use);
* `gathered_bytes(message)`: every process's bytes (JSON, words), of any size or cut to a budget;
* `everyone(answer)`: every process's yes or no;
* `gravest(code, problem)`: the gravest code any process holds, with the words of the first;
* `process_0_decides(values)`: process 0's values on every process (a clock read on one host);
* `agreed_checks()`: a block of start-up checks whose failure on any process stops all;
* `announced(error)` and `exit_on_announced_failure()`: a failure one process alone meets where
  the others do not wait for its answer (they are in a collective it never enters), told to them
  through the key-value store of JAX's distributed runtime, on which each waits in a thread.

Nothing here runs a collective in a single-process run. The gathers go through
`multihost_utils`, which moves host values over the devices' own collectives (gloo on CPUs).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxscale.cli import fail_with
from jaxscale.errors import TRANSIENT_EXIT_CODE, USAGE_EXIT_CODE, JaxscaleError, TransientError

# Room for one process's words in an agreement (a failing check, a save's problem); longer ones
# are cut. The gather moves this many bytes from every process, whatever the words' length.
MESSAGE_BYTES = 4096


def gathered(row: np.ndarray) -> np.ndarray:
    """Every process's `row` (a small array of the same shape and dtype on each), stacked along a
    new first axis in process order."""
    row = np.asarray(row)
    if jax.process_count() == 1:
        return row[None]
    return np.asarray(multihost_utils.process_allgather(row)).reshape(-1, *row.shape)


def gathered_bytes(message: bytes, budget: int | None = None) -> list[bytes]:
    """Every process's `message`, in process order. With a `budget`, each is cut to that many
    bytes and one gather moves them; without, any size, in two gathers (the sizes, then the
    messages padded to the largest)."""
    if budget is not None:
        message = message[:budget]
        size = budget
    else:
        size = int(gathered(np.int64(len(message))).max())
    padded = np.zeros(size + 8, np.uint8)  # 8 bytes of length before the message
    padded[:8] = np.frombuffer(np.int64(len(message)).tobytes(), np.uint8)
    padded[8:8 + len(message)] = np.frombuffer(message, np.uint8)
    rows = gathered(padded)
    return [row[8:8 + int(row[:8].view(np.int64)[0])].tobytes() for row in rows]


def everyone(answer: bool) -> np.ndarray:
    """Every process's `answer`, a bool array in process order."""
    return gathered(np.bool_(answer)).reshape(-1)


def gravest(code: int, problem: str) -> tuple[int, str]:
    """(the gravest (largest) `code` any process holds, "process <first with it>: <its
    problem>", or "" when the gravest is 0), the same on every process."""
    if jax.process_count() == 1:
        return code, problem
    answers = _coded_messages(code, problem)
    worst = max(c for c, _ in answers)
    first = next(process for process, (c, _) in enumerate(answers) if c == worst)
    return worst, (f"process {first}: {answers[first][1]}" if worst else "")


def _coded_messages(code: int, words: str) -> list[tuple[int, str]]:
    """Every process's (code, words), the words cut to MESSAGE_BYTES, in one gather."""
    rows = gathered_bytes(np.int64(code).tobytes() + words.encode()[:MESSAGE_BYTES],
                          8 + MESSAGE_BYTES)
    return [(int(np.frombuffer(row[:8], np.int64)[0]), row[8:].decode(errors="replace"))
            for row in rows]


def process_0_decides(values: np.ndarray) -> np.ndarray:
    """Process 0's `values` (a small array, the same shape on each process) on every process:
    for answers one host's clock or measurement gives, which every process must act on alike."""
    if jax.process_count() == 1:
        return np.asarray(values)
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(values)))


@contextlib.contextmanager
def agreed_checks():
    """Runs a block of start-up checks, then makes its verdict every process's: when a check fails
    on some processes (one host's disk, data or memory), all of them raise the error of the first
    (lowest id) of those, of its kind (JaxscaleError: exit 2, TransientError: exit 75), after one
    agreement. Without it the others would go on into the next collective and wait there until
    the heartbeat timeout. The block must hold no collective: a process whose check failed skips
    the rest of it."""
    failure = None
    try:
        yield
    except (JaxscaleError, TransientError) as e:
        failure = e
    if jax.process_count() == 1:
        if failure is not None:
            raise failure
    elif (agreed := _first_failure(failure)) is not None:
        raise agreed from failure


def _first_failure(failure: JaxscaleError | TransientError | None) -> Exception | None:
    """The error every process raises: the first failing process's, the same line on each (with
    that process's id when not every process failed); None when all passed."""
    kind = (0 if failure is None else
            TRANSIENT_EXIT_CODE if isinstance(failure, TransientError) else USAGE_EXIT_CODE)
    answers = _coded_messages(kind, str(failure or ""))
    failed = [process for process, (code, _) in enumerate(answers) if code]
    if not failed:
        return None
    code, text = answers[failed[0]]
    if len(failed) < len(answers):
        text = f"process {failed[0]} of {len(answers)}: {text}"
    return _failure(code, text)


# The key under which a process announces the failure that ends the run ("<exit code> <line>").
_FAILURE_KEY = "jaxscale/failure"
# Milliseconds a waiting thread's request to the key-value store lasts before it asks again; a
# process that ends waits as long for the thread to stop (see `_stop_waiting`).
_WATCH_MS = 1000
# The key the announcer sets as it exits, and how long process 0 waits for it before exiting:
# the coordination service lives in process 0, and JAX aborts every process still connected when
# it goes, so an announcer still on its way out would end with "lost its coordinator" (75), not
# with the failure it announced. Its way out unwinds the trainer (its inputs, its checkpoints)
# first, which a loaded host can stretch to seconds: 20 s, within the 30 s bound
# docs/checkpointing.md states.
_LEFT_KEY = "jaxscale/failure-announcer-left"
_ANNOUNCER_GRACE_MS = 20_000
# How long process 0 still waits once the key is set: the announcer sets it just before its
# os._exit, and a loaded host can hold it between the two; a service gone in that moment made
# JAX's agent abort it, with a second `error:` line and 75 in place of its own status (seen in
# CI with the refusal's 2, and in a full slow run here).
_ANNOUNCER_EXIT_S = 2.0
_announced = threading.Event()  # this process announced a failure: it exits on its own
_told: list[JaxscaleError | TransientError] = []  # the failure another process announced
_ending = threading.Event()  # this process is ending: the waiting thread stops


def announced(error: JaxscaleError | TransientError) -> JaxscaleError | TransientError:
    """Tells every other process of `error`, which this process alone met at a point where the
    others go on without its answer (the blocking part of a save, past Orbax's barriers), and
    returns the error to raise here: its kind, its words prefixed "process <i> of <n>: ", which
    every process prints (`exit_on_announced_failure`). The caller must then exit at once
    (`failure_announced`): a clean exit waits for the others at JAX's shutdown barrier."""
    if jax.process_count() == 1:
        return error
    text = f"process {jax.process_index()} of {jax.process_count()}: {error}"
    code = TRANSIENT_EXIT_CODE if isinstance(error, TransientError) else USAGE_EXIT_CODE
    _announced.set()
    try:  # the first announcement stands; a later one finds the key taken
        _client().key_value_set(_FAILURE_KEY, f"{code} {text}")
    except jax.errors.JaxRuntimeError as e:
        if "ALREADY_EXISTS" not in str(e):
            raise
    return _failure(code, text)


def failure_announced() -> bool:
    """Whether this process announced a failure (`announced`) and so must exit at once
    (`leave`)."""
    return _announced.is_set()


def leave(status: int) -> None:
    """Ends the process that announced a failure at once, with `status`, telling process 0 it has
    gone (process 0 waits for that before it exits, taking the coordination service with it)."""
    try:
        _client().key_value_set(_LEFT_KEY, "")
    except jax.errors.JaxRuntimeError:  # the service is gone already: nobody waits
        pass
    os._exit(status)


def announced_elsewhere() -> JaxscaleError | TransientError | None:
    """The failure another process announced, once this process's waiting thread has it; else
    None. A process that then loses the announcer in a collective (it exited) ends with that
    failure, not as one that lost a peer (runtime/distributed.py `exit_if_peer_lost`)."""
    return _told[0] if _told else None


def exit_on_announced_failure() -> None:
    """In a multi-process run, starts a thread that waits for a failure another process announces
    and then ends this process at once (os._exit) with that failure's line and status: this
    process may be waiting in a collective the failing one never enters, which would hold it
    until the heartbeat timeout (minutes). Call once, after `jax.distributed` is initialized."""
    if jax.process_count() > 1:
        thread = threading.Thread(target=_wait_for_failure, args=(_client(),), daemon=True,
                                  name="jaxscale-failure-watch")
        thread.start()
        atexit.register(_stop_waiting, thread)  # before JAX's shutdown, registered earlier


def _stop_waiting(thread: threading.Thread) -> None:
    """Ends the waiting thread before the interpreter does: a thread still inside the
    runtime's C++ call when Python finalizes aborts the process (SIGABRT)."""
    _ending.set()
    thread.join()


def _wait_for_failure(client) -> None:
    while not _ending.is_set():
        try:
            value = client.blocking_key_value_get(_FAILURE_KEY, _WATCH_MS)
            break
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                return  # the runtime is shut down or lost: the run ends another way
    else:
        return
    if not _announced.is_set():  # the announcer exits on its own, with its own line
        code, _, text = value.partition(" ")
        _told.append(_failure(int(code), text))
        if jax.process_index() == 0:
            try:
                client.blocking_key_value_get(_LEFT_KEY, _ANNOUNCER_GRACE_MS)
                time.sleep(_ANNOUNCER_EXIT_S)
            except jax.errors.JaxRuntimeError:  # not gone within the grace: exit all the same
                pass
        fail_with(_told[0], exit=os._exit)


def _failure(code: int, text: str) -> JaxscaleError | TransientError:
    return (TransientError if code == TRANSIENT_EXIT_CODE else JaxscaleError)(text)


def _client():
    from jax._src import distributed  # the runtime's client, as jax.distributed reaches it

    return distributed.global_state.client
