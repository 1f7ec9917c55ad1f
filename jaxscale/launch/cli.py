"""What the launcher CLIs share: the `error: ...` exit, and checking a training command's config
against the cluster shape before anything is started or submitted."""

from __future__ import annotations

import argparse
import sys

from jaxscale.config import MESH_AXES, validate
from jaxscale.errors import USAGE_EXIT_CODE, JaxscaleError


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_EXIT_CODE)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error: ...` line and exit status 2."""

    def error(self, message: str) -> None:
        fail(f"{message} (see {self.prog} --help)")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def check_train_args(train_args: list[str], num_devices: int, num_granules: int) -> None:
    """Loads the config named by `train_args` (as `jaxscale.train` would, overrides included) and
    validates it for `num_devices` devices in `num_granules` DCN-connected granules (TPU slices, or
    hosts where there are no slices); exits with `error: ...` if it does not fit, so that nothing
    is started for a run that would fail at once."""
    from jaxscale.train import parse_flags  # a bad flag exits here, exactly as training would

    config, _ = parse_flags([sys.argv[0], *train_args])
    # Granules count only when the config asks for DCN factors (see jaxscale.mesh.dcn_granules).
    granules = 1 if all(int(config.mesh.dcn[a]) == 1 for a in MESH_AXES) else num_granules
    try:
        validate(config, num_devices, granules)
    except JaxscaleError as e:
        fail(f"{e} (checked for {num_devices} devices in {num_granules} hosts/slices)")
