"""Weight gradients reduced across the data-parallel devices in bfloat16 against float32
(`precision.grad_reduce_dtype`): what each does to the training loss, and what each costs on the
wire.

    python benchmarks/grad_reduce.py [--steps=200] [--config.KEY=VALUE ...]

Loss: `configs/tiny.py` (bfloat16 compute) at data=8 on 8 simulated CPU devices, trained `steps`
steps with each setting from the same initial state on the same batches (seed 0): the per-step
losses' mean over the last 50 steps and over all, and bfloat16 minus float32. Two yardsticks for
that difference: float32 reduction at data=4 on 4 devices (the same sums in another order: what
float32 rounding alone moves the loss by) and float32 compute at data=8 (what bfloat16 compute
itself costs; the setting is moot there). On CPU a bfloat16 reduction's partial sums are rounded
to bfloat16 but XLA:CPU adds them in float32 and rounds the total once, where a TPU or GPU
all-reduce may round at each hop: the loss difference here is a lower bound.

Bytes: the gradient collectives of the same config's train step (all-reduces and reduce-scatters,
bytes per device summed over a step's executions, scalars included) compiled by the TPU compiler
for 8 chips (v5p:2x2x2) at data=8: XLA:CPU widens every bfloat16 collective to float32, so the CPU
program would show float32 on both sides. Printed with the bytes the parameters predict: 4 a
parameter for float32, 2 for those that follow the setting (attention, feed-forward, head) with
bfloat16. The last line is `ratio: X` = float32 bytes / bfloat16 bytes per step.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from flax import nnx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxscale.cli import parse_train_flags  # noqa: E402
from jaxscale.data import make_input  # noqa: E402
from jaxscale.models.spec import abstract_model, model_config  # noqa: E402
from jaxscale.plan.collectives import bytes_by_kind, parse_collectives  # noqa: E402
from jaxscale.plan.compiled import compile_train_step  # noqa: E402
from jaxscale.plan.targets import parse_target, target_devices  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402

SETTINGS = ("bfloat16", "float32")
# The weights whose gradients follow the setting (jaxscale.models.layers.weight_matmul's).
FOLLOWING = {"blocks/attn/q", "blocks/attn/k", "blocks/attn/v", "blocks/attn/o",
             "blocks/mlp/gate", "blocks/mlp/up", "blocks/mlp/down", "head"}
LAST = 50  # the steps whose mean loss is the run's final figure
MIB = 2 ** 20


def config_for(setting: str, overrides: list[str], compute: str = "bfloat16", data: int = 8):
    config, _ = parse_train_flags([
        "grad_reduce", "--config=configs/tiny.py", f"--config.mesh.data={data}",
        f"--config.precision.compute_dtype={compute}",
        f"--config.precision.grad_reduce_dtype={setting}", *overrides])
    return config


def losses(config, steps: int) -> np.ndarray:
    """The per-step losses of `steps` steps from seed `train.seed` on the run's own batches, on
    the first `mesh.data` devices."""
    config.train.steps = steps
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir, devices=jax.devices()[:config.mesh.data])
        step, _ = trainer.compile_train_step()
        state = trainer.program.init_state(config.train.seed)
        found = []
        sharding = trainer.program.batch_sharding
        with contextlib.closing(make_input(config, "train", sharding)) as batches:
            for _ in range(steps):
                state, metrics = step(state, next(batches))
                # One step at a time: with many queued, XLA:CPU's 8 simulated devices can wait
                # on each other's collectives past its rendezvous timeout.
                found.append(float(metrics["loss"]))
        return np.asarray(found)


def wire_bytes(config) -> int:
    """Bytes per device per step of the gradient reductions, compiled for 8 TPU chips."""
    compiled, _ = compile_train_step(config, target_devices(parse_target("v5p:2x2x2")))
    found = bytes_by_kind(parse_collectives(compiled.as_text(),
                                            {a: config.mesh[a] for a in ("data", "fsdp")}))
    return found["all-reduce"] + found["reduce-scatter"]


def predicted_bytes(config, setting: str) -> int:
    """4 bytes a parameter, 2 for those that follow a bfloat16 setting."""
    params = nnx.to_pure_dict(nnx.split(abstract_model(model_config(config)))[1])
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        follows = jax.tree_util.keystr(path, simple=True, separator="/") in FOLLOWING
        total += math.prod(leaf.shape) * (2 if follows and setting == "bfloat16" else 4)
    return total


def summary(found: np.ndarray) -> str:
    return f"last {LAST} steps {found[-LAST:].mean():.4f}, all {found.mean():.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args, overrides = parser.parse_known_args()

    print(f"configs/tiny.py, data=8 on 8 simulated CPU devices, {args.steps} steps, seed 0; "
          "mean loss")
    runs = {s: losses(config_for(s, overrides), args.steps) for s in SETTINGS}
    for setting, found in runs.items():
        print(f"  bfloat16 compute, {setting} reduction: {summary(found)}")
    reordered = losses(config_for("float32", overrides, data=4), args.steps)
    print(f"  bfloat16 compute, float32 reduction at data=4: {summary(reordered)}")
    wide = losses(config_for("float32", overrides, compute="float32"), args.steps)
    print(f"  float32 compute: {summary(wide)}")
    for name, a, b in [("bfloat16 - float32 reduction", runs["bfloat16"], runs["float32"]),
                       ("yardstick: data=4 - data=8, float32 reduction", reordered,
                        runs["float32"]),
                       ("yardstick: bfloat16 - float32 compute", runs["float32"], wide)]:
        diff = a - b
        print(f"{name}: last {LAST} {diff[-LAST:].mean():+.4f}, all {diff.mean():+.4f}, "
              f"largest |step| {np.abs(diff).max():.4f}")

    print("gradient reductions per step per device, TPU v5p:2x2x2 (compiled only), data=8")
    measured = {}
    for setting in SETTINGS:
        config = config_for(setting, overrides)
        measured[setting] = wire_bytes(config)
        print(f"  {setting}: {measured[setting] / MIB:.3f} MiB "
              f"(the parameters predict {predicted_bytes(config, setting) / MIB:.3f} MiB)")
    print("ratio below: float32 / bfloat16 reduction, bytes per step on the wire")
    print(f"ratio: {measured['float32'] / measured['bfloat16']:.4f}")


if __name__ == "__main__":
    main()
