"""One verdict for every process of a run: a block of start-up checks whose failure on some
processes (one host's disk, data or memory) stops all of them with the same error, after one
allgather, instead of leaving the others to wait in the next collective until the heartbeat
timeout (`agreed_checks`)."""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxscale.errors import TRANSIENT_EXIT_CODE, USAGE_EXIT_CODE, JaxscaleError, TransientError

# Room for a failing start-up check's message in the agreement; a longer one is cut.
_AGREED_MESSAGE_BYTES = 4096


@contextlib.contextmanager
def agreed_checks():
    """Runs a block of start-up checks, then makes its verdict every process's: when a check fails
    on some processes (one host's disk, data or memory), all of them raise the error of the first
    (lowest id) of those, of its kind (JaxscaleError: exit 2, TransientError: exit 75), after one
    allgather. Without it the others would go on into the next collective and wait there until
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
    message = str(failure or "").encode()[:_AGREED_MESSAGE_BYTES]
    mine = np.zeros(3 + _AGREED_MESSAGE_BYTES, np.uint8)  # kind, message length (2 bytes), message
    mine[:3] = kind, len(message) // 256, len(message) % 256
    mine[3:3 + len(message)] = np.frombuffer(message, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(mine))  # in process order
    failed = [process for process, row in enumerate(rows) if row[0]]
    if not failed:
        return None
    row = rows[failed[0]]
    text = row[3:3 + 256 * int(row[1]) + int(row[2])].tobytes().decode(errors="replace")
    if len(failed) < len(rows):
        text = f"process {failed[0]} of {len(rows)}: {text}"
    return (TransientError if row[0] == TRANSIENT_EXIT_CODE else JaxscaleError)(text)
