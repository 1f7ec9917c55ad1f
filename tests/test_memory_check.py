"""Before its first step every run logs its compiled train step's memory per device next to the
device's capacity, and refuses to start, with one `error:` line and before writing anything,
when the step does not fit (issue 11). `mesh.auto` trains with the step the planner compiled."""

import hashlib
import math
import os
import subprocess
import sys

import jax
import pytest

from jaxscale.checks import validate
from jaxscale.errors import ConfigError
from jaxscale.observe.device_memory import StepMemory, check_fits, device_capacity, memory_line
from jaxscale.plan.auto import planned_config
from jaxscale.runtime.chips import GIB
from jaxscale.trainer import Trainer
from tests.helpers import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config=configs/tiny.py", "--config.train.steps=2", "--config.train.log_every=1",
         "--config.train.eval_every=0", "--config.train.seq_len=32",
         "--config.train.batch_size=8", "--config.model.n_layers=1", "--config.model.d_model=64",
         "--config.model.n_heads=2", "--config.model.n_kv_heads=1", "--config.model.mlp_dim=128",
         "--config.data.sources=(dict(format='synthetic'),)", "--config.checkpoint.every_steps=2"]
TOO_SMALL = "--config.performance.device_memory_gib=0.0001"  # 100 KiB; the step needs ~2 MiB


def train(workdir, *overrides) -> tuple[int, str, str]:
    # Every compiled program goes to the compilation cache (not only those that take 1 s), so a
    # refused start that let its staged cache into the workdir would show.
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", *SMALL, f"--workdir={workdir}", *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    return result.returncode, result.stdout, result.stderr


def listing(root) -> dict[str, str]:
    """{relative path: sha256 of the file, or 'folder'} of everything under `root`."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        for name in subfolders:
            found[os.path.relpath(os.path.join(folder, name), root)] = "folder"
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


def assert_refused(status: int, err: str) -> None:
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("error: the train step does not fit: per device it needs "), err
    for named in ("performance.device_memory_gib=0.0001", "GiB short", "mesh.fsdp",
                  "model.remat=full", "train.microbatches", "optim.moment_dtype=bfloat16",
                  "python -m jaxscale.plan"):
        assert named in lines[0], named


@pytest.mark.slow
def test_a_step_that_does_not_fit_stops_the_run_before_it_writes(tmp_path):
    """A fresh workdir stays empty (the compilation cache included); a run that fits logs its
    step's memory against the capacity and trains; resuming it with too little memory stops
    with the workdir byte for byte as it was."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    status, out, err = train(fresh, TOO_SMALL)
    assert_refused(status, err)
    assert "train step memory per device: arguments " in out
    assert os.listdir(fresh) == []

    status, out, err = train(fresh, "--config.performance.device_memory_gib=1")
    assert status == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("train step memory per device: "))
    assert "temporaries" in line and " of capacity 1 GiB (0%, performance.device_memory_gib=1)" \
        in line, line
    # The train step compiled before the run could write reached the cache once it could.
    assert any(n.startswith("jit_train_step-") for n in os.listdir(fresh / "compilation_cache"))

    before = listing(fresh)
    status, out, err = train(fresh, "--config.train.steps=4", TOO_SMALL)
    assert_refused(status, err)
    assert listing(fresh) == before


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


MEMORY = StepMemory(arguments=3 * GIB, outputs=3 * GIB, aliased=3 * GIB, temporaries=5 * GIB,
                    code=0)


def test_the_capacity_is_the_override_else_the_smallest_allocator_limit_else_unknown():
    gpus = [FakeDevice({"bytes_limit": 60 * GIB}), FakeDevice({"bytes_limit": 59 * GIB})]
    assert device_capacity(gpus, 0.0) == (59 * GIB, "the allocator's limit")
    assert device_capacity(gpus, 7.5) == (int(7.5 * GIB), "performance.device_memory_gib=7.5")
    assert device_capacity(jax.devices(), 0.0) is None  # CPUs report no limit
    assert device_capacity([FakeDevice(None)], 2.0)[0] == 2 * GIB

    assert MEMORY.total == 8 * GIB  # the donated outputs reuse the arguments' buffers
    assert memory_line(MEMORY, (59 * GIB, "the allocator's limit")).endswith(
        "total 8 GiB of capacity 59 GiB (14%, the allocator's limit)")
    assert "capacity is unknown" in memory_line(MEMORY, None)
    check_fits(MEMORY, None)  # unknown: not refused
    check_fits(MEMORY, (8 * GIB, "exactly enough"))
    with pytest.raises(ConfigError, match=r"holds 7.5 GiB \(x\): 0.5 GiB short; to fit, "):
        check_fits(MEMORY, (int(7.5 * GIB), "x"))


@pytest.mark.parametrize("gib", [-1.0, math.inf, math.nan])
def test_a_device_memory_that_is_no_size_is_a_config_error(gib):
    config = small_config(data=8)
    config.performance.device_memory_gib = gib
    with pytest.raises(ConfigError, match=r"^performance\.device_memory_gib=\S+ must be "):
        validate(config, 8)


# Two trials (each candidate timed) is the slower case: it runs with the slow tests.
@pytest.mark.parametrize("trials", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_mesh_auto_trains_with_the_step_the_planner_compiled(tmp_path, trials):
    """The train step is compiled by the planner only, once per candidate it times (none when
    it trusts its ranking): the trainer runs the chosen one's executable."""
    compiled = []

    def count(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration" and \
                "train_step" in kwargs.get("fun_name", ""):
            compiled.append(kwargs["fun_name"])

    config = small_config(data=8)
    config.mesh.update(auto=True, auto_trials=trials)
    config.train.steps = 2
    config.data.sources = (dict(format="synthetic"),)
    config.checkpoint.update(enabled=False, compilation_cache=False)
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        config, planned_step = planned_config(config, jax.devices())
        metrics = Trainer(config, str(tmp_path), planned_step=planned_step).run()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert math.isfinite(metrics["loss"])
    assert len(compiled) == trials, compiled
