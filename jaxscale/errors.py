"""Errors a user can cause. The CLI prints them as one `error: ...` line and exits with status 2."""

USAGE_EXIT_CODE = 2


class JaxscaleError(Exception):
    """A problem the user can fix (bad config, bad path, bad data); the message says how."""


class ConfigError(JaxscaleError):
    """The config is invalid: the message names the key, the bad value and the fix."""

# A run that stopped on purpose to be restarted (preemption, SIGTERM): it saved a checkpoint and
# launchers (supervise, Slurm requeue, JobSet restart policy) should start it again.
RESTART_EXIT_CODE = 42
