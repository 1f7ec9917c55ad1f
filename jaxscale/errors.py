"""Errors a user can cause, and the exit statuses jaxscale's processes and launchers agree on.

The CLI prints a user error as one `error: ...` line and exits with status 2.
"""

import signal

USAGE_EXIT_CODE = 2


class JaxscaleError(Exception):
    """A problem the user can fix (bad config, bad path, bad data); the message says how."""


class ConfigError(JaxscaleError):
    """The config is invalid: the message names the key, the bad value and the fix."""

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
    if status == INTERRUPTED_EXIT_CODE:
        return f"exited with status {status} (interrupted)"
    return f"exited with status {status}"


def interrupted(status: int) -> bool:
    """Whether a child's `Popen.returncode` means it stopped for a Ctrl-C: it exited 130, or it was
    killed by SIGINT (a program that does not catch it)."""
    return status in (INTERRUPTED_EXIT_CODE, -signal.SIGINT)


def shell_exit_status(status: int) -> int:
    """A child's `Popen.returncode` as a shell reports it: a signal death becomes 128 + signal."""
    return 128 - status if status < 0 else status
