"""Memory per chip of a train step, from the TPU compiler (no TPU needed).

    pip install -e '.[tpu]'
    python benchmarks/memory.py                             # llama3_8b on v5p-64 (64 chips)
    python benchmarks/memory.py --target=v5e-16
    python benchmarks/memory.py --config=configs/llama_1b.py --config.model.attention=xla

    benchmarks/maxtext/setup.sh /tmp/maxtext-venv           # MaxText 0.2.5 + jaxscale, one jax
    /tmp/maxtext-venv/bin/python benchmarks/memory.py --maxtext
    /tmp/maxtext-venv/bin/python benchmarks/memory.py --maxtext --maxtext_tiling=2,4,8,16

Settings (overridable with --config.KEY=VALUE after them): mesh fsdp = all chips, 2 sequences of
2048 tokens per chip, `model.remat=full`, bfloat16 compute, float32 parameters and Adam moments.

The figure is the compiler's peak per chip (`StepMemory.peak`: the buffers live at once,
arguments included). The breakdown's total (arguments + new outputs + temporaries, what MaxText's
`train_compile` prints) is shown too, but on a TPU it overstates: the compiler's temporaries
count more than its heap in HBM (for llama3_8b about the donated arguments' size again).

--maxtext also runs MaxText's own `train_compile` (benchmarks/maxtext/train_compile.py, in a
child process of this same Python: the same jax and libtpu, which it prints) with these settings
in MaxText's keys: once with MaxText's defaults, and once for each --maxtext_tiling value N with
its memory-lean loss (`num_vocab_tiling=N`: the logits made for 1/N of the tokens at a time;
by default N=4, the leanest for llama3-8b here, MAXTEXT_TILING below). It prints each
MaxText breakdown beside jaxscale's and each peak's ratio, and ends with `ratio: X` = jaxscale's
peak / the smallest MaxText peak (its leanest setting, named in the line above); below 1.0
jaxscale needs less. It needs the venv benchmarks/maxtext/setup.sh makes, and a config MaxText can
express: a model with the shapes of one of MaxText's (llama3_8b: llama3-8b), one TPU slice,
data/fsdp/tensor mesh axes with the default rules, remat `full`, float32 Adam moments on the
device. A setting it cannot translate stops it (exit 2) rather than compare unlike things; what
no key can match (the attention kernel, how the loss holds its logits, the dtype gradients are
summed in) is listed in benchmarks/maxtext/train_compile.py. --maxtext_set="KEY=VALUE ..." adds
MaxText overrides to every MaxText compile, shown in its line. Without --maxtext nothing is
compared: no ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the target; nothing runs here

from jaxscale.cli import Option, fail, parse_config_flags
from jaxscale.config import default_config
from jaxscale.errors import ConfigError
from jaxscale.observe.device_memory import StepMemory
from jaxscale.parallel.mesh import resolve_mesh_shape
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.targets import Target, parse_target, target_devices
from jaxscale.runtime.chips import GIB

# MaxText's leanest loss for memory.py's comparison: of num_vocab_tiling 2, 4, 8 and 16, 4 is the
# first with the smallest peak (8 and 16 peak at the same byte: the layers' backward pass, not the
# loss, holds the peak then; benchmarks/RESULTS.md, 2026-11-27).
MAXTEXT_TILING = 4
OPTIONS = [Option("target", "v5p-64", "what to compile for: v5p-64, v5e-16, v5p:2x2x1, cpu:8",
                  "TARGET"),
           Option("per_chip_batch", 2, "sequences per chip", "N"),
           Option("maxtext_tiling", str(MAXTEXT_TILING), "with --maxtext: the values of MaxText's "
                  "num_vocab_tiling to compile besides its default (1), comma-separated; the "
                  "ratio is against the smallest peak ('' for MaxText's defaults alone)",
                  "N,N,..."),
           Option("maxtext_set", "", "with --maxtext: MaxText config overrides, space-separated, "
                  "for every MaxText compile (e.g. vocab_tiling_ag_once=true)", "'KEY=VALUE ...'")]
MAXTEXT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "maxtext",
                              "train_compile.py")
# MaxText's models (configs/models/NAME.yml in its package) by jaxscale's model keys.
MAXTEXT_MODELS = {
    "llama3-8b": dict(name="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, head_dim=128, mlp_dim=14336, rope_theta=500000.0,
                      norm_eps=1e-5, tie_embeddings=False),
}
# Cloud TPU (and MaxText) count TensorCores in v4 and v5p slice names, two a chip.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}


def maxtext_settings(config, target: Target) -> dict[str, str]:
    """The MaxText overrides (KEY=VALUE) that make its train_compile compile what `config`
    compiles for `target`; ConfigError naming a setting MaxText cannot express."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"--maxtext: {what}, which MaxText's train_compile cannot be given: "
                           "nothing like to compare with")
    if target.platform != "tpu" or target.granules != 1:
        raise refuse(f"target {target.name!r} is not one TPU slice")
    # Lazy: MaxText is only in the venv of benchmarks/maxtext/setup.sh (an optional dependency).
    from maxtext.utils.accelerator_to_spec_map import UserFacingNameToSystemCharacteristics
    generation, shape = target.topology.split(":")
    name = f"{generation}-{target.num_devices * _CORES_PER_CHIP[generation]}"
    spec = UserFacingNameToSystemCharacteristics.get(name)
    if (spec is None or spec.devices_per_slice != target.num_devices
            or spec.topology_name.split(":")[1] != shape):
        raise refuse(f"MaxText knows no slice {name} of shape {shape}")
    model = config.model
    maxtext_model = next((m for m, keys in MAXTEXT_MODELS.items()
                          if all(model[k] == v for k, v in keys.items())), None)
    if maxtext_model is None or model.rope_scaling.type != "none" or model.moe.experts:
        raise refuse("the model's shapes are none of MaxText's models here ("
                     + ", ".join(MAXTEXT_MODELS) + "; llama3-8b is configs/llama3_8b.py)")
    if model.remat != "full":
        raise refuse(f"model.remat={model.remat} saves other tensors than any MaxText "
                     "remat_policy (use full)")
    ici, _ = resolve_mesh_shape(config.mesh, target.num_devices, target.granules)
    if any(ici[axis] != 1 for axis in ("pipeline", "expert", "context")):
        raise refuse(f"mesh {ici} uses more axes than data, fsdp and tensor")
    if config.sharding.rules.to_dict() != default_config().sharding.rules.to_dict():
        raise refuse("sharding.rules differ from the defaults")
    if config.optim.moment_dtype != "float32" or config.optim.offload_state:
        raise refuse("Adam's moments are not float32 on the device (MaxText's mu_dtype sets "
                     "the first moment only)")
    if config.precision.compute_dtype not in ("bfloat16", "float32"):
        raise refuse(f"precision.compute_dtype={config.precision.compute_dtype}")
    settings = {
        "model_name": maxtext_model,
        "compile_topology": name,
        "compile_topology_num_slices": 1,
        "ici_data_parallelism": ici["data"],
        "ici_fsdp_parallelism": ici["fsdp"],
        "ici_tensor_parallelism": ici["tensor"],
        "dcn_data_parallelism": 1,
        "per_device_batch_size": f"{config.train.batch_size / target.num_devices:g}",
        "max_target_length": config.train.seq_len,
        "gradient_accumulation_steps": config.train.microbatches,
        "remat_policy": "full",
        "dtype": config.precision.compute_dtype,
        "weight_dtype": "float32",
        "mu_dtype": "float32",
        "opt_type": "adamw",
        "gradient_clipping_threshold": f"{config.optim.grad_clip:g}",
        "shard_optimizer_over_data": str(config.sharding.optimizer_state == "data").lower(),
    }
    return {k: str(v) for k, v in settings.items()}


def versions() -> dict[str, str]:
    found = {}
    for name in ("jax", "jaxlib", "libtpu"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "none"
    return found


def maxtext_tilings(text: str, tokens_per_chip: float) -> list[int]:
    """--maxtext_tiling's values of num_vocab_tiling; ConfigError naming one MaxText refuses (its
    loss splits a chip's tokens into that many equal tiles)."""
    tilings = []
    for item in filter(None, text.split(",")):
        n = int(item) if item.isdigit() else 0
        if n < 2 or tokens_per_chip % n:
            raise ConfigError(f"--maxtext_tiling: {item!r} is no num_vocab_tiling MaxText "
                              f"compiles here: give whole numbers above 1 that divide the "
                              f"{tokens_per_chip:g} tokens per chip, e.g. --maxtext_tiling=2,4,8")
        tilings.append(n)
    return tilings


def maxtext_overrides(text: str) -> dict[str, str]:
    """--maxtext_set's KEY=VALUE items; ConfigError for one that is not, or that sets
    num_vocab_tiling (--maxtext_tiling's: each MaxText compile has its own)."""
    overrides = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--maxtext_set: {item!r} is not KEY=VALUE")
        if key == "num_vocab_tiling":
            raise ConfigError(f"--maxtext_set: {item!r}: MaxText's tiling is "
                              f"--maxtext_tiling's (e.g. --maxtext_tiling={value})")
        overrides[key] = value
    return overrides


def run_maxtext(settings: dict[str, str]) -> tuple[list[str], StepMemory]:
    """MaxText's train_compile with `settings`, in a child process of this Python (the same jax
    and libtpu): (its printed lines, its step's memory)."""
    with tempfile.NamedTemporaryFile("w+", prefix="maxtext-train-compile-", suffix=".log",
                                     delete=False) as log:
        result = subprocess.run(
            [sys.executable, MAXTEXT_SCRIPT, *(f"{k}={v}" for k, v in settings.items())],
            stdout=subprocess.PIPE, stderr=log, text=True, check=False)
    prefix = "maxtext_memory_bytes: "
    lines = result.stdout.splitlines()
    figures = [line[len(prefix):] for line in lines if line.startswith(prefix)]
    if result.returncode != 0 or len(figures) != 1:
        with open(log.name) as f:
            tail = f.read()[-6000:]
        sys.stderr.write(f"{result.stdout}\n{tail}\n")
        fail(f"MaxText's train_compile failed (exit {result.returncode}); its log is "
             f"{log.name}", exit_code=1)
    os.unlink(log.name)
    return [line for line in lines if not line.startswith(prefix)], StepMemory(
        **json.loads(figures[0]))


def main(argv: list[str]) -> None:
    # A plain switch (jaxscale.cli's options all take a value).
    maxtext = "--maxtext" in argv[1:]
    argv = [a for a in argv if a != "--maxtext"]
    if not any(a.startswith("--config=") or a == "--config" for a in argv[1:]):
        argv = [argv[0], "--config=configs/llama3_8b.py", *argv[1:]]
    config, options = parse_config_flags(argv, prog="python benchmarks/memory.py",
                                         about=__doc__, options=OPTIONS)
    overridden = " ".join(argv[1:])
    for option in ("maxtext_set", "maxtext_tiling"):
        if f"--{option}" in overridden and not maxtext:
            fail(f"--{option} needs --maxtext")
    try:
        target = parse_target(options["target"])
    except ConfigError as e:
        fail(str(e))
    # The comparison's settings, unless the command line set them.
    if "--config.mesh." not in overridden:
        config.mesh.update(data=1, fsdp=target.num_devices, tensor=1)
    if "--config.train.batch_size" not in overridden:
        config.train.batch_size = options["per_chip_batch"] * target.num_devices
    if "--config.train.seq_len" not in overridden:
        config.train.seq_len = 2048
    if "--config.model.remat" not in overridden:
        config.model.remat = "full"

    maxtext_runs = []
    if maxtext:
        try:
            overrides = maxtext_overrides(options["maxtext_set"])
            tilings = maxtext_tilings(options["maxtext_tiling"], config.train.batch_size
                                      * config.train.seq_len / target.num_devices)
        except ConfigError as e:
            fail(str(e))
        # The distribution, not the module: benchmarks/maxtext/ (beside this script, on
        # sys.path) would pass for a namespace package named maxtext.
        try:
            version("maxtext")
        except PackageNotFoundError:
            fail("--maxtext needs MaxText installed beside jaxscale: run "
                 "benchmarks/maxtext/setup.sh /tmp/maxtext-venv, then "
                 "/tmp/maxtext-venv/bin/python benchmarks/memory.py --maxtext")
        try:
            settings = maxtext_settings(config, target)
        except ConfigError as e:
            fail(str(e))
        settings.update(overrides)
        # MaxText first, one compile at a time: this process has not loaded libtpu yet, so two
        # compilers are never in memory at once.
        variants = [("its defaults", {})] + [(f"num_vocab_tiling={n}", {"num_vocab_tiling": n})
                                             for n in tilings]
        maxtext_runs = [(name, *run_maxtext({**settings, **variant}))
                        for name, variant in variants]

    try:
        devices = target_devices(target)
    except ConfigError as e:
        fail(str(e))
    start = time.perf_counter()
    compiled, memory = compile_train_step(config, devices)
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    mesh = {axis: config.mesh[axis] for axis in ("data", "fsdp", "tensor")}
    found = versions()
    print(", ".join(f"{k} {v}" for k, v in found.items()))
    print(f"{overridden or 'defaults'}: {target.name} ({devices[0].device_kind}), mesh "
          f"{mesh}, batch {config.train.batch_size} x "
          f"{config.train.seq_len}, remat {config.model.remat}; compiled in {seconds:.0f} s")
    print(memory.line())
    if target.platform == "tpu":  # a CPU's compiler reports only the arguments as its peak
        print(f"peak (the compiler's): {memory.peak / GIB:.3g} GiB")
    print(f"bytes accessed per step (compiler's estimate): "
          f"{cost.get('bytes accessed', 0) / GIB:.1f} GiB")
    if not maxtext:
        print("no ratio: run with --maxtext (in the venv of benchmarks/maxtext/setup.sh) to "
              "compile MaxText's step with the same settings and divide by its peak")
        return
    for _, lines, _ in maxtext_runs:
        for line in lines:
            print(line)
        # The child's first line: "maxtext 0.2.5, jax ..., jaxlib ..., libtpu ...".
        theirs = next((dict(part.split(" ", 1) for part in line.split(", "))
                       for line in lines if line.startswith("maxtext ")), {})
        if any(theirs.get(k) != v for k, v in found.items()):
            fail(f"MaxText ran with {theirs}, jaxscale with {found}: not comparable",
                 exit_code=1)
    for name, _, theirs in maxtext_runs:
        print(f"MaxText's peak (the compiler's), {name}: {theirs.peak / GIB:.3g} GiB; "
              f"jaxscale's / it: {memory.peak / theirs.peak:.4f} (totals', both overstated: "
              f"{memory.total / theirs.total:.4f})")
    name, _, leanest = min(maxtext_runs, key=lambda run: run[2].peak)
    print(f"the baseline: MaxText's leanest here, {name} ({leanest.peak / GIB:.3g} GiB)")
    print(f"ratio: {memory.peak / leanest.peak:.4f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
