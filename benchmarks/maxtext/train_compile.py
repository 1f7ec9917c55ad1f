"""MaxText's memory figure, reproduced: MaxText 0.2.5's own `train_compile` (run from its installed
package, never copied here) compiles its train step for a TPU slice on this host, TPU or not, and
this prints the compiled step's memory per chip in the same format as benchmarks/memory.py.

    benchmarks/maxtext/setup.sh /tmp/maxtext-venv            # maxtext 0.2.5 + this repo, one jax
    /tmp/maxtext-venv/bin/python benchmarks/maxtext/train_compile.py
    /tmp/maxtext-venv/bin/python benchmarks/maxtext/train_compile.py num_vocab_tiling=2

Arguments are MaxText config overrides, KEY=VALUE, on top of MaxText's `configs/base.yml` and
SETTINGS below: benchmarks/memory.py's default comparison (llama3-8b on 64 v5p chips, which Cloud
TPU and MaxText call `v5p-128`; FSDP over all 64; 2 x 2048 tokens per chip; remat `full`;
bfloat16 compute; float32 weights and Adam moments). `benchmarks/memory.py --maxtext` runs this
script with the settings translated from its own config, once as they are and once with MaxText's
memory-lean loss (`num_vocab_tiling=N`, below), and divides by the smaller peak.

What cannot be matched with jaxscale (both sides keep their own default):
- attention: MaxText's `autoselected` (its splash kernel on TPU, block sizes 512) against
  jaxscale's `model.attention=auto` (splash through jaxscale/parallel/attention.py, its blocks);
- the loss: by default MaxText computes the float32 logits of all positions at once
  (`num_vocab_tiling=1`); its `num_vocab_tiling=N` splits a chip's tokens into N tiles, each
  tile's logits over the whole vocabulary, in a scan. jaxscale's default on a TPU makes the
  logits of 1024 positions x 16384 vocabulary entries at a time (`model.loss_chunk_len`,
  `model.loss_vocab_tile`). memory.py compares with both of MaxText's, the ratio against the
  leaner;
- the gradients' reduction over the fsdp axis: jaxscale makes and sums the weights' gradients in
  `precision.grad_reduce_dtype` (bfloat16 by default); MaxText has no such key (its `grad_dtype`
  casts the gradients after they are summed): its sum is whatever XLA makes of bfloat16 compute
  on float32 weights (`--config.precision.grad_reduce_dtype=float32` is jaxscale's nearest);
- the TPU devices: MaxText describes `v5p-128` with its own topology arguments (`v5:4x4x4`,
  chip config `megacore`, wrap-around links) where jaxscale asks for `v5p:4x4x4`; both are 64
  chips of the same torus;
- MaxText's train_compile compiles with `jax_default_prng_impl=unsafe_rbg` and the libtpu flag
  `--xla_tpu_spmd_rng_bit_generator_unsafe=true` (it sets both itself); a step without dropout
  draws no random numbers, so neither should matter;
- MaxText's state and batch carry its own extras (a step counter, packed-sequence segment ids and
  positions), jaxscale its own; both are small.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from importlib.metadata import version

# memory.py's default comparison, in MaxText's keys. model_name picks configs/models/llama3-8b.yml
# (the same shapes as configs/llama3_8b.py).
SETTINGS = {
    "model_name": "llama3-8b",
    "compile_topology": "v5p-128",  # 64 chips: Cloud TPU counts v5p TensorCores, two a chip
    "compile_topology_num_slices": "1",
    "ici_fsdp_parallelism": "64",
    "ici_data_parallelism": "1",
    "ici_tensor_parallelism": "1",
    "dcn_data_parallelism": "1",
    "per_device_batch_size": "2",
    "max_target_length": "2048",
    "gradient_accumulation_steps": "1",
    "remat_policy": "full",
    "dtype": "bfloat16",
    "weight_dtype": "float32",
    "mu_dtype": "float32",  # Adam's first moment; the second is kept in the weights' dtype
    "opt_type": "adamw",
    "gradient_clipping_threshold": "1.0",
}
# The prefix of the machine-readable line benchmarks/memory.py reads.
BYTES_PREFIX = "maxtext_memory_bytes: "


def versions() -> str:
    return ", ".join(f"{name} {version(name)}" for name in ("maxtext", "jax", "jaxlib", "libtpu"))


def parse_overrides(args: list[str]) -> dict[str, str]:
    overrides = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key or key.startswith("-"):
            sys.stderr.write(f"error: {arg!r} is not a MaxText override; pass KEY=VALUE, e.g. "
                             "num_vocab_tiling=2\n")
            sys.exit(2)
        overrides[key] = value
    return overrides


def main(args: list[str]) -> None:
    if any(a in ("-h", "--help", "help") for a in args):
        print(__doc__)
        return
    settings = {**SETTINGS, **parse_overrides(args)}
    # libtpu takes a host-wide lock meant for processes that run on a TPU; compiling needs none.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for the topology; nothing runs here

    from absl import app
    from maxtext.trainers.pre_train import train_compile

    from jaxscale.observe.device_memory import step_memory

    captured = {}
    jit_and_compile = train_compile.jit_and_compile

    def keep_compiled(*a, **k):
        # MaxText prints the memory analysis but keeps the compiled step to itself; this keeps it
        # too, to read the same figures with jaxscale's reader.
        start = time.perf_counter()
        captured["compiled"] = jit_and_compile(*a, **k)
        captured["seconds"] = time.perf_counter() - start
        return captured["compiled"]

    train_compile.jit_and_compile = keep_compiled
    base_yml = os.path.join(os.path.dirname(train_compile.pyconfig.__file__), "base.yml")
    with tempfile.TemporaryDirectory(prefix="maxtext-") as out:
        # MaxText writes its run folder (config, tensorboard) under base_output_directory,
        # ./maxtext_output by default; keep it out of the caller's folder.
        settings.setdefault("base_output_directory", out)
        settings.setdefault("run_name", "train_compile")
        argv = ["train_compile", base_yml, *(f"{k}={v}" for k, v in settings.items())]
        # MaxText's main prints its config and its whole cost analysis: to stderr with them, so
        # stdout carries only the figures.
        stdout = sys.stdout
        sys.stdout = sys.stderr

        def run(argv):
            train_compile.main(argv)
            sys.stdout = stdout
            report(settings, captured, step_memory)

        app.run(run, argv=argv)


def report(settings: dict[str, str], captured: dict, step_memory) -> None:
    memory = step_memory(captured["compiled"])
    shown = " ".join(f"{k}={v}" for k, v in settings.items()
                     if k not in ("base_output_directory", "run_name"))
    print(versions())
    print(f"MaxText train_compile: {shown}; compiled in {captured['seconds']:.0f} s")
    print(memory.line())
    print(BYTES_PREFIX + json.dumps(dataclasses.asdict(memory)))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
