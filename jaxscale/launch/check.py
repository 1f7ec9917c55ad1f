"""A smoke test for a new cluster: joins the processes, then sums over every device of every
process, and checks the answer. Run it with the same launcher as training, before training:

    python -m jaxscale.launch.local --processes=2 --module=jaxscale.launch.check
    srun python -m jaxscale.launch.check            # Slurm; same on TPU VMs and GKE pods

Each device contributes its process id + 1, so a wrong sum means some process's devices did not
take part. `--steps` repeats the sum `--interval_s` apart (to watch a run survive, or not, a kill).
"""

from __future__ import annotations

import os
import sys
import time

from jaxscale.cli import ArgumentParser, fail, fail_with
from jaxscale.errors import INTERRUPTED_EXIT_CODE, JaxscaleError, TransientError
from jaxscale.launch.cli import nonnegative_float, positive
from jaxscale.runtime import distributed


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m jaxscale.launch.check",
                            description="Check that every process joins and collectives work.",
                            epilog="example: python -m jaxscale.launch.local --processes=2 "
                                   "--module=jaxscale.launch.check -- --steps=3")
    parser.add_argument("--steps", type=positive, default=1,
                        help="How many times to sum over every device (default 1).")
    parser.add_argument("--interval_s", type=nonnegative_float, default=0.0,
                        help="Seconds to wait between two sums (default 0).")
    parser.add_argument("--init_timeout_s", type=positive,
                        default=distributed.DEFAULT_INIT_TIMEOUT_S,
                        help="Seconds to wait for every process to join before naming the "
                             f"missing ones (default {distributed.DEFAULT_INIT_TIMEOUT_S}).")
    parser.add_argument("--heartbeat_timeout_s", type=positive,
                        default=distributed.DEFAULT_HEARTBEAT_TIMEOUT_S,
                        help="Seconds without a heartbeat after which a process counts as dead "
                             "and the others stop (default "
                             f"{distributed.DEFAULT_HEARTBEAT_TIMEOUT_S}).")
    return parser


def parse_args(argv: list[str]):
    return make_parser().parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    try:
        distributed.initialize(args.init_timeout_s, args.heartbeat_timeout_s)
    except (JaxscaleError, TransientError) as e:  # a peer that never came: 75, as in training
        fail_with(e)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    me, n = jax.process_index(), jax.process_count()
    print(f"process {me} of {n} (pid {os.getpid()}): {jax.local_device_count()} local of "
          f"{jax.device_count()} {jax.devices()[0].platform} devices", flush=True)
    mesh = jax.make_mesh((jax.device_count(),), ("devices",))
    local = np.full((jax.local_device_count(),), me + 1, np.float32)
    values = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("devices")), local)
    total_of = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    expected = sum((p + 1) * jax.local_device_count() for p in range(n))
    for step in range(args.steps):
        total = float(total_of(values))
        if total != expected:
            fail(f"step {step}: the sum over all devices is {total}, expected {expected}; "
                 "some process's devices did not take part")
        print(f"step {step}: sum over {jax.device_count()} devices = {total:g} (ok)", flush=True)
        time.sleep(args.interval_s)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        print("check: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT_CODE)
