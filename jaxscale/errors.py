"""Errors, and the exit statuses jaxscale's processes and launchers agree on.

    0    finished
    2    USAGE_EXIT_CODE: the user must change something (config, flags, data, a damaged
         checkpoint); a restart would fail the same way, so nothing retries it
    42   RESTART_EXIT_CODE: preempted (SIGTERM) after saving; restart me at once
    75   TRANSIENT_EXIT_CODE (sysexits' EX_TEMPFAIL): the infrastructure failed for now (storage
         I/O, the coordinator, a peer process); retry with backoff, every checkpoint is intact
    130  INTERRUPTED_EXIT_CODE: Ctrl-C after saving; not restarted
    anything else: a crash (a bug); restarted within a crash budget

Preemptions and transient failures never use up a crash budget: `supervise`, `launch.local`,
the JobSet's `podFailurePolicy` and the Slurm script act on these statuses alike (the table in
docs/launch.md). The CLI prints a user error or a transient failure as one
`error: ...` line.
"""

import signal
from typing import Any, Callable

USAGE_EXIT_CODE = 2
TRANSIENT_EXIT_CODE = 75


class JaxscaleError(Exception):
    """A problem the user can fix (bad config, bad path, bad data); the message says how."""


class ConfigError(JaxscaleError):
    """The config is invalid: the message names the key, the bad value and the fix."""


class TransientError(Exception):
    """The infrastructure failed for now (storage, the coordinator, a peer): nothing the user must
    change, nothing damaged; the process exits 75 to be retried with backoff. Not a JaxscaleError:
    a launcher must never treat it as the user's mistake."""

# What JSON calls the values json.loads returns, for messages that name what a file holds.
_JSON_NAMES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def json_object(value: Any, what: str, fix: str = "",
                error: Callable[[str], Exception] = JaxscaleError) -> dict:
    """`value`, the JSON read from `what` (a file, a line of one), when it is an object; else
    `error` of the one line "<what> is a JSON array, not an object; <fix>" (no fix: the error's
    catcher words it, e.g. for a damaged checkpoint). Every JSON the program reads expects an
    object, and a list or a number in its place would fail later on, far from the file, with a
    traceback."""
    if isinstance(value, dict):
        return value
    problem = f"{what} is a JSON {_JSON_NAMES[type(value)]}, not an object"
    raise error(f"{problem}; {fix}" if fix else problem)


# A run that stopped on purpose to be restarted (preemption, SIGTERM): it saved a checkpoint and
# launchers (supervise, Slurm requeue, JobSet restart policy) should start it again.
RESTART_EXIT_CODE = 42
# Stopped by Ctrl-C after saving (the shell's 128 + SIGINT): supervisors do not restart it, and
# running the same command again resumes it.
INTERRUPTED_EXIT_CODE = 130


def describe_exit(status: int) -> str:
    """How a child process ended, from its `Popen.returncode` (negative: killed by a signal)."""
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:  # a real-time signal has no name
            return f"was killed by signal {-status}"
    if status == RESTART_EXIT_CODE:
        return f"exited with status {status} (restart me)"
    if status == TRANSIENT_EXIT_CODE:
        return f"exited with status {status} (transient failure, retry)"
    if status == INTERRUPTED_EXIT_CODE:
        return f"exited with status {status} (interrupted)"
    return f"exited with status {status}"


def interrupted(status: int) -> bool:
    """Whether a child's `Popen.returncode` means it stopped for a Ctrl-C: it exited 130, or it was
    killed by SIGINT (a program that does not catch it)."""
    return status in (INTERRUPTED_EXIT_CODE, -signal.SIGINT)


def is_crash(status: int) -> bool:
    """Whether a child's `Popen.returncode` is a crash, the only kind of ending that uses up a
    crash budget: anything but 0, 2, 42, 75 and an interrupt, signals included."""
    return (status not in (0, USAGE_EXIT_CODE, RESTART_EXIT_CODE, TRANSIENT_EXIT_CODE)
            and not interrupted(status))


def shell_exit_status(status: int) -> int:
    """A child's `Popen.returncode` as a shell reports it: a signal death becomes 128 + signal."""
    return 128 - status if status < 0 else status
