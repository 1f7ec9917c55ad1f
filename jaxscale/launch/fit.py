"""Checks that a training command's config fits a cluster shape, before anything is started:

    python -m jaxscale.launch.fit --devices=16 --granules=2 -- --config=configs/tiny.py \\
        --config.mesh.dcn.data=2

Prints `ok: ...` and exits 0, or prints `error: ...` and exits 2. Used by deploy/tpu/tpu.sh and
deploy/slurm/jaxscale.sbatch; the Python launchers run the same check themselves. With an elastic
range (`--min_granules`) only its minimum must run: a count on which the run would leave a whole
host's devices idle runs on fewer. `--given_granules=N` (the hosts a Slurm job was given) prints,
last, `start: K`: the most of them the run starts on, the others idle. With
`--gpu=h100` (h200, a100; the granules are nodes of such GPUs) the train step is also compiled
for them, on this host without a GPU (the `jaxscale[gpu-compile]` extra), and a step that needs
more than JAX's allocator will have on each GPU is refused the same way.
"""

from __future__ import annotations

import sys

from jaxscale.cli import ArgumentParser, fail
from jaxscale.launch.cli import check_train_args, parse_launcher_args, positive
from jaxscale.runtime.chips import GPU_CHIPS


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m jaxscale.launch.fit",
                            description="Check a training config against a cluster shape; the "
                                        "training flags go after --.",
                            epilog="example: python -m jaxscale.launch.fit --devices=16 "
                                   "--granules=2 -- --config=configs/tiny.py")
    parser.add_argument("--devices", type=positive, required=True,
                        help="Devices in the run, over all hosts.")
    parser.add_argument("--granules", type=positive, default=1,
                        help="TPU slices, or hosts where devices have no slices (default 1).")
    parser.add_argument("--gpu", choices=sorted(GPU_CHIPS), default="",
                        help="The devices are GPUs of this model, --granules nodes of them: "
                             "compile the train step for them and check its memory (needs the "
                             "jaxscale[gpu-compile] extra; without it, a note says so).")
    parser.add_argument("--min_granules", type=positive, default=None,
                        help="An elastic range's minimum (hosts): the run may go on with any "
                             "count from it up to --granules; the minimum is checked as the run "
                             "refits the config for it, and a count above it that would leave a "
                             "host all idle runs on fewer (default: --granules, not elastic).")
    parser.add_argument("--given_granules", type=positive, default=None,
                        help="The hosts a job of the range was given: print, last, `start: K`, "
                             "the most of them (from --min_granules) on which the run leaves no "
                             "host's devices all idle (default: print nothing more).")
    return parser


def main(argv: list[str]) -> None:
    args, train_args = parse_launcher_args(make_parser(), argv, "jaxscale.train")
    if args.devices % args.granules:
        fail(f"--devices={args.devices} do not split evenly over --granules={args.granules}: "
             "every host or slice has as many devices; pass a --devices that --granules "
             "divides")
    minimum = args.min_granules or args.granules
    if minimum > args.granules:
        fail(f"--min_granules={minimum} is above --granules={args.granules}: the range's minimum "
             "is at most its maximum; pass a smaller --min_granules")
    given = args.given_granules or args.granules
    if not minimum <= given <= args.granules:
        fail(f"--given_granules={given} is outside the range {minimum}-{args.granules}; pass the "
             "hosts the job was given, within the range")
    per_granule = args.devices // args.granules
    config = check_train_args(train_args, args.devices, args.granules, args.gpu,
                              fewer_devices=(minimum * per_granule,)
                              if minimum < args.granules else ())
    print(f"ok: the config fits {args.devices} devices in {args.granules} hosts/slices")
    if args.given_granules is not None:
        from jaxscale.checks import runs_on  # imports JAX, as the check did

        start = max(n for n in range(minimum, given + 1)
                    if runs_on(config, n, per_granule, args.granules))
        print(f"start: {start}")


if __name__ == "__main__":
    main(sys.argv[1:])
