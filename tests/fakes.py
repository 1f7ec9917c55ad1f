"""Fakes that a multi-process test puts into the processes it starts: `fake_env` gives their
environment a `sitecustomize` that installs them when Python starts (a trainer runs as its
guard's child, so a fake must be in every process), each on the one process it names. jaxscale
itself reads no test switch.

- small devices: that process's devices hold 1 byte, so its memory check fails (the others'
  pass);
- a slow host: that process's steps take `seconds` longer, in its own host time.
"""

from __future__ import annotations

import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_DEVICES = "JAXSCALE_FAKE_SMALL_DEVICES"  # the process whose devices hold 1 byte
SLOW_HOST = "JAXSCALE_FAKE_SLOW_HOST"  # "<process>:<seconds>": its steps take that much longer
SMALL_DEVICES_SAYS = "a fake device of 1 byte (tests/fakes.py)"


def fake_env(folder, *, small_devices: int | None = None,
             slow_host: tuple[int, float] | None = None) -> dict[str, str]:
    """Environment variables that make the Python processes started with them install the fakes
    asked for; `folder`: an empty folder for the sitecustomize."""
    hook = os.path.join(folder, "fakes_hook")
    os.makedirs(hook, exist_ok=True)
    with open(os.path.join(hook, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write("from tests.fakes import install\ninstall()\n")
    env = {"PYTHONPATH": os.pathsep.join([hook, REPO])}
    if small_devices is not None:
        env[SMALL_DEVICES] = str(small_devices)
    if slow_host is not None:
        env[SLOW_HOST] = f"{slow_host[0]}:{slow_host[1]}"
    return env


def install() -> None:
    """Installs the fakes this process's environment asks for (`fake_env`)."""
    from jaxscale import trainer

    if SMALL_DEVICES in os.environ:
        process = int(os.environ[SMALL_DEVICES])
        real_capacity = trainer.device_capacity

        def device_capacity(*args, **kwargs):
            import jax

            if jax.process_index() == process:
                return 1, SMALL_DEVICES_SAYS
            return real_capacity(*args, **kwargs)
        trainer.device_capacity = device_capacity
    if SLOW_HOST in os.environ:
        process, seconds = os.environ[SLOW_HOST].split(":")
        real_add = trainer.BadSteps.add

        def add(self, *args, **kwargs):  # once a step, outside the time waiting for devices
            import jax

            if jax.process_index() == int(process):
                time.sleep(float(seconds))
            return real_add(self, *args, **kwargs)
        trainer.BadSteps.add = add
