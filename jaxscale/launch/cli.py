"""What the launcher CLIs share (besides jaxscale.cli's ArgumentParser): the number types of their
flags, splitting a command line at `--`, and checking a training command's config against the
cluster shape before anything is started or submitted."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from jaxscale.cli import fail, number_flag, parse_train_flags
from jaxscale.errors import JaxscaleError
from jaxscale.kinds import real, whole


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


# The share of a GPU's memory JAX's allocator takes unless XLA_PYTHON_CLIENT_MEM_FRACTION says.
JAX_MEMORY_FRACTION = 0.75

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


def check_train_args(train_args: list[str], num_devices: int, num_granules: int,
                     gpu: str = "", fewer_devices: tuple[int, ...] = ()):
    """Loads the config named by `train_args` (as `jaxscale.train` would, overrides included) and
    validates it for `num_devices` devices in `num_granules` DCN-connected granules (TPU slices, or
    hosts where there are no slices); exits with `error: ...` if it does not fit, so that nothing
    is started for a run that would fail at once. With `gpu` (h100, h200, a100: the granules are
    nodes of those GPUs) the train step is also compiled for them (`check_compiled_fit`).
    `fewer_devices`: the counts an elastic range may run on (one granule), each checked as the run
    refits the config for it (jaxscale/training/elastic.py). Where the processes know their
    devices (JAXSCALE_DEVICES_PER_PROCESS), a count that cannot run starts on fewer hosts and keeps
    the rest as spares (runtime/rendezvous.py): the range's minimum is the only one to check.
    Returns the config."""
    # Imported here: they import JAX, which supervise's start does not need.
    from jaxscale.checks import idle_devices, validate
    from jaxscale.parallel.mesh import asks_for_dcn

    config, _ = parse_train_flags([sys.argv[0], *train_args])  # a bad flag exits here
    # Granules count only when the config asks for DCN factors, as in parallel.mesh.dcn_granules.
    granules = num_granules if asks_for_dcn(config.mesh) else 1
    try:
        validate(config, num_devices, granules)
    except JaxscaleError as e:
        fail(f"{e} (checked for {num_devices} devices in {num_granules} hosts/slices)")
    per_granule = num_devices // num_granules
    for fewer in fewer_devices:
        try:
            idle = idle_devices(config, fewer, per_granule, num_devices)
        except JaxscaleError as e:
            fail(f"{e} (checked for {fewer} devices, as the run would go on after losing hosts; "
                 "raise the range's minimum or change the mesh)")
        # A process whose devices are all idle holds no shard of the state, and the trainer
        # reads it (int(state.step)): it would crash at its first step.
        if idle >= per_granule:
            nearest = _nearest_batch(config, fewer_devices, num_devices, per_granule)
            fail(f"on {fewer} devices the run would leave {idle} idle (no width of them divides "
                 f"train.batch_size={config.train.batch_size}), a whole host's {per_granule}, "
                 "which the trainer cannot run; pass a train.batch_size that the range runs on"
                 + (f" (the nearest: {nearest})" if nearest else "")
                 + ", or raise the range's minimum")
    if gpu:
        check_compiled_fit(config, f"{gpu}:{num_granules}x{num_devices // num_granules}")
    return config


def _nearest_batch(config, fewer_devices: tuple[int, ...], full_devices: int,
                   per_granule: int) -> int | None:
    """The train.batch_size nearest to the config's (the larger on a tie) on which every count
    checked leaves no whole host idle; None if there is none."""
    from jaxscale.checks import idle_devices

    batch = config.train.batch_size
    for offset in range(1, batch + 1):
        for candidate in (batch + offset, batch - offset):
            if candidate < 1:
                continue
            trial = config.copy_and_resolve_references()
            trial.train.batch_size = candidate
            try:
                if all(idle_devices(trial, n, per_granule, full_devices) < per_granule
                       for n in (*fewer_devices, full_devices)):
                    return candidate
            except JaxscaleError:  # a batch the mesh or the config cannot take
                continue
    return None


def check_compiled_fit(config, target_spec: str) -> None:
    """Compiles `config`'s train step for the GPU target `target_spec` (`h100:2x8`) with XLA's GPU
    compiler, here and without a GPU, and exits with `error: ...` when the step needs more than
    JAX's allocator will have on each GPU: XLA_PYTHON_CLIENT_MEM_FRACTION (this environment's,
    else JAX's default 0.75) of its memory, or `performance.device_memory_gib` when the config
    sets it, which the run's own start-up check uses too. Without JAX's CUDA plugin, says in one
    line that it did not compile, and returns. Nodes of more GPUs than the GPU's nodes have are
    refused either way: no cluster has them."""
    from jaxscale.plan.targets import parse_target, target_devices
    from jaxscale.runtime import cuda_plugin

    try:
        target = parse_target(target_spec)
    except JaxscaleError as e:
        fail(str(e))
    if not cuda_plugin.installed():
        print(f"note: the train step was not compiled for {target_spec}: no GPU compiler here; "
              f"{cuda_plugin.INSTALL_HINT}", file=sys.stderr)
        return
    import jax

    jax.config.update("jax_platforms", "cpu")  # compiled for the GPUs described, run nowhere
    from jaxscale.observe.device_memory import check_fits
    from jaxscale.plan.compiled import compile_train_step
    from jaxscale.runtime.chips import GIB

    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEMORY_FRACTION))
    gib = config.performance.device_memory_gib
    capacity = ((int(gib * GIB), f"performance.device_memory_gib={gib:g}") if gib else
                (int(fraction * target.chip.hbm_bytes),
                 f"{fraction:.0%} of a {target.chip.name}'s {target.chip.hbm_bytes / GIB:.0f} GiB, "
                 "XLA_PYTHON_CLIENT_MEM_FRACTION"))
    try:
        _, memory = compile_train_step(config, target_devices(target))
        check_fits(memory, capacity)
    except JaxscaleError as e:
        fail(f"{e} (compiled for {target_spec})")
    print(f"compiled for {target_spec}: {memory.total / GIB:.3g} GiB per GPU, within "
          f"{capacity[0] / GIB:.3g} GiB ({capacity[1]})", file=sys.stderr)
