"""What the launcher CLIs share (besides jaxscale.cli's ArgumentParser): the number types of their
flags, splitting a command line at `--`, and checking a training command's config against the
cluster shape before anything is started or submitted."""

from __future__ import annotations

import argparse
import signal
import sys

from jaxscale.cli import fail, number_flag, parse_train_flags
from jaxscale.kinds import real, whole
from jaxscale.errors import JaxscaleError

class StopRequest:
    """What a launcher has been told by signals: the first SIGTERM or SIGINT (`signal`) goes on to
    each child once; a second Ctrl-C (`killed`) escalates to SIGKILL. Recording is all a signal
    handler does, so it is safe wherever the main thread is."""

    def __init__(self):
        self.signal: int | None = None
        self.killed = False

    def record(self, signum: int) -> None:
        if self.signal is None:
            self.signal = signum
        elif signum == signal.SIGINT == self.signal:  # a second Ctrl-C (not one during a SIGTERM's
            self.killed = True                       # save: that run is saving for a restart)

    def undelivered(self, delivered: set[int]) -> list[int]:
        """The signals a child already sent `delivered` should get now; adds them to it."""
        wanted = [signum for signum, on in ((self.signal, self.signal is not None),
                                            (signal.SIGKILL, self.killed))
                  if on and signum not in delivered]
        delivered.update(wanted)
        return wanted


# argparse types of the launchers' number flags: the same kinds, and messages, as the config's
# numbers (a NaN or an infinite wait is refused like a negative one).
positive = number_flag(whole("[1, inf)"))
nonnegative = number_flag(whole("[0, inf)"))
nonnegative_float = number_flag(real("[0, inf)"))


def parse_launcher_args(parser: argparse.ArgumentParser, argv: list[str], passed_to: str):
    """Parses a launcher's own flags, those before `--`; returns them and the arguments after `--`,
    which go to `passed_to` (the program the launcher starts). A flag the launcher does not know is
    an `error: ...` exit; given without any `--`, the error suggests putting it after one."""
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = parser.parse_known_args(argv[:split])
    if unknown and split == len(argv):
        own = [a for a in argv if a not in unknown]
        parser.error(f"unrecognized arguments: {' '.join(unknown)}; flags for {passed_to} go "
                     f"after --, e.g. {' '.join([parser.prog, *own, '--', *unknown])}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args, argv[split + 1:]


def check_train_args(train_args: list[str], num_devices: int, num_granules: int) -> None:
    """Loads the config named by `train_args` (as `jaxscale.train` would, overrides included) and
    validates it for `num_devices` devices in `num_granules` DCN-connected granules (TPU slices, or
    hosts where there are no slices); exits with `error: ...` if it does not fit, so that nothing
    is started for a run that would fail at once."""
    # Imported here: they import JAX, which supervise's start does not need.
    from jaxscale.checks import validate
    from jaxscale.parallel.mesh import asks_for_dcn

    config, _ = parse_train_flags([sys.argv[0], *train_args])  # a bad flag exits here
    # Granules count only when the config asks for DCN factors, as in parallel.mesh.dcn_granules.
    granules = num_granules if asks_for_dcn(config.mesh) else 1
    try:
        validate(config, num_devices, granules)
    except JaxscaleError as e:
        fail(f"{e} (checked for {num_devices} devices in {num_granules} hosts/slices)")
