"""`python -m jaxscale.train --config=configs/NAME.py --workdir=DIR [--config.KEY=VALUE ...]`

Parses the flags, validates, and hands over to `Trainer`. A mistake the user can fix prints one
`error: ...` line and exits with status 2, before anything is compiled or written.
"""

from __future__ import annotations

import os
import sys

from absl import flags
from ml_collections import config_flags

from jaxscale.errors import USAGE_EXIT_CODE, JaxscaleError

_REPO_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "configs")
DEFAULT_CONFIG = os.path.join(_REPO_CONFIGS, "tiny.py")
DEFAULT_WORKDIR = os.path.join("runs", "default")

def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(USAGE_EXIT_CODE)


def parse_flags(argv: list[str]):
    """(config, workdir) from the command line. Config flags are defined here rather than at import:
    ml_collections loads the config file and applies overrides while defining the flag, and a bad
    override must become an `error:` line, not a traceback."""
    try:
        config_flag = config_flags.DEFINE_config_file(
            "config", DEFAULT_CONFIG, "Config file (a Python file with get_config()); override any "
            "key with --config.KEY=VALUE, e.g. --config.train.steps=100.", lock_config=True)
        workdir_flag = flags.DEFINE_string(
            "workdir", DEFAULT_WORKDIR, "Folder for metrics, TensorBoard files and checkpoints.")
        rest = flags.FLAGS(argv)
        config = config_flag.value
        config.train  # ml_collections loads the file lazily; make a bad file fail here
    except flags.Error as e:
        fail(str(e).splitlines()[0])
    except OSError as e:  # the config file could not be loaded
        fail(f"cannot load the config file: {' '.join(str(e).split())}; pass "
             "--config=configs/NAME.py")
    except (KeyError, AttributeError, ValueError, TypeError) as e:  # a bad --config.KEY override
        hint = " ".join(str(e).strip("'\"").replace("\\n", " ").split())
        fail(f"bad override among {_overrides(argv)} ({hint}); the keys are those of "
             "jaxscale/config.py:default_config()")
    if len(rest) > 1:
        fail(f"unexpected arguments {rest[1:]}; flags look like --workdir=DIR --config.KEY=VALUE")
    return config, workdir_flag.value


def _overrides(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--config.")]


def main(argv: list[str]) -> None:
    config, workdir = parse_flags(argv)
    # Import JAX only now, so that --help and flag errors stay fast.
    from jaxscale import distributed
    from jaxscale.trainer import Trainer

    try:
        # Before anything touches a device: every process of a multi-host run must join first.
        distributed.initialize(timeout_s=config.distributed.init_timeout_s,
                               heartbeat_timeout_s=config.distributed.heartbeat_timeout_s)
        Trainer(config, workdir).run()
    except JaxscaleError as e:
        fail(str(e))


if __name__ == "__main__":
    main(sys.argv)
