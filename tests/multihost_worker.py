"""One process of a multi-process training run, for tests/test_checkpoint_multihost.py:

    python tests/multihost_worker.py WORKDIR STEPS

Joins the other processes (jaxscale.distributed's explicit mode, from the environment that
`jaxscale.launch.local.process_env` builds) and trains a small model on an fsdp mesh over all of
their devices, checkpointing only when preempted.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxscale import distributed  # noqa: E402


def main(workdir: str, steps: int) -> None:
    distributed.initialize()
    import jax

    from jaxscale.trainer import Trainer
    from tests.helpers import small_config

    config = small_config(fsdp=jax.device_count())
    config.train.update(steps=steps, seq_len=32, log_every=1)
    config.checkpoint.every_steps = 0
    Trainer(config, workdir).run()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
