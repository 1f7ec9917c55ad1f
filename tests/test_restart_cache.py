"""Cheap restarts (issue 51, item 5): the persistent compilation cache keeps the train step of
every process count the run has started on, so a restart onto a count seen before compiles
nothing; the start-up line says how long each phase took. Starts on 2 processes, then 1, then 2
again (launch.local, 4 simulated CPU devices in all, fsdp=4): the third adds no program to the
cache and process 0 says it loaded its train step from it.

Only process 0 writes programs into the cache (JAX's rule), so the others load only where their
cache keys are process 0's. A key holds the staging folder's path (one per process) unless the
XLA caches beside the persistent one are off, which `use_compilation_cache` turns off: the key no
longer depends on the folder. Beyond that, JAX keys a CPU program by its own process's topology,
so on this machine process 1 still compiles at every start (the line says "by 1 of 2 processes");
whether a TPU or GPU slice's processes share one key is not measured here."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import cache_key, compiler

from jaxscale.runtime.compilation_cache import use_compilation_cache
from tests.helpers import REPO

MODEL = ["--config=configs/tiny.py", "--config.train.log_every=1", "--config.train.seq_len=32",
         "--config.train.batch_size=8", "--config.train.eval_every=0",
         "--config.model.n_layers=1", "--config.model.d_model=64", "--config.model.n_heads=2",
         "--config.model.n_kv_heads=1", "--config.model.mlp_dim=128", "--config.mesh.data=1",
         "--config.mesh.fsdp=4", "--config.precision.compute_dtype=float32",
         "--config.checkpoint.every_steps=2"]
STARTUP = re.compile(r"^\[0\] start-up: rendezvous [\d.]+s, restore [\d.]+s, compile [\d.]+s "
                     r"\(train step (compiled|loaded from the compilation cache)[^)]*\)$", re.M)


def start(workdir, cache, processes, steps):
    """Trains to `steps` on `processes` processes; returns how the start-up line says the train
    step came to process 0 ("compiled", or "loaded from the compilation cache")."""
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.launch.local", f"--processes={processes}",
         f"--devices_per_process={4 // processes}", "--", *MODEL,
         f"--config.train.steps={steps}", f"--config.checkpoint.compilation_cache_dir={cache}",
         f"--workdir={workdir}"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert f"[0] done: step {steps}" in output, output[-3000:]
    lines = STARTUP.findall(output)
    assert len(lines) == 1, output[-3000:]
    return lines[0]


def programs(cache):
    return {name for name in os.listdir(cache) if "train_step" in name}


def cache_key_in(cache_dir):
    """The persistent cache's key of a small program compiled with the cache in `cache_dir`."""
    use_compilation_cache(str(cache_dir))
    try:
        module = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compiler_ir("stablehlo")
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
        return cache_key.get(module, np.array(jax.devices()[:1]), options,
                             jax.devices()[0].client)
    finally:
        use_compilation_cache(None)


def test_a_programs_cache_key_does_not_depend_on_the_cache_folder(tmp_path):
    """Each process stages its programs in a folder of its own: the key must not hold it."""
    assert cache_key_in(tmp_path / "process_0") == cache_key_in(tmp_path / "process_1")


@pytest.mark.slow
def test_a_restart_onto_a_process_count_seen_before_loads_its_train_step(tmp_path):
    """Three runs of 2 steps share one cache, as the starts of one run do (the learning-rate
    schedule, baked into the step, follows train.steps: a run's starts all have the same)."""
    cache = tmp_path / "cache"
    assert start(tmp_path / "two", cache, 2, 2) == "compiled"
    on_two = programs(cache)
    assert on_two
    assert start(tmp_path / "one", cache, 1, 2) == "compiled"
    seen = programs(cache)
    assert seen > on_two  # the step for 1 process is kept beside the one for 2
    assert start(tmp_path / "two_again", cache, 2, 2) == "loaded from the compilation cache"
    assert programs(cache) == seen
