"""The GPU XLA flags (`performance.xla_flags`): they exist in the installed jaxlib, go only where
the backend will be a GPU, and never override flags the user set."""

import os
import subprocess
import sys

import pytest

from jaxscale.errors import ConfigError
from jaxscale.runtime import xla_flags

AUTO = [f"--{name}={value}" for name, value, _ in xla_flags.GPU_FLAGS]


def start_jax(flags: str) -> subprocess.CompletedProcess:
    """A fresh process that starts JAX's CPU backend with XLA_FLAGS=`flags`."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_gpu_flags_exist_in_this_jaxlib():
    # XLA parses every flag, GPU ones included, on any backend: CPU proves they exist.
    result = start_jax(" ".join(AUTO))
    assert result.returncode == 0 and result.stdout.strip() == "cpu", result.stderr[-2000:]


def test_an_unknown_flag_aborts_xla():
    # The test above could not fail if XLA ignored unknown flags.
    result = start_jax(" ".join([*AUTO, "--xla_gpu_enable_no_such_thing=true"]))
    assert result.returncode != 0
    assert "Unknown flag in XLA_FLAGS: --xla_gpu_enable_no_such_thing=true" in result.stderr


@pytest.mark.parametrize("platforms, plugin, gpu", [
    ("cuda", False, True), ("gpu,cpu", False, True), ("cpu", True, False),
    ("tpu", True, False), ("cpu,cuda", True, False), ("", True, True), ("", False, False)])
def test_gpu_is_decided_without_starting_a_backend(monkeypatch, platforms, plugin, gpu):
    found = {"jax_cuda12_plugin"} if plugin else set()
    monkeypatch.setattr(xla_flags.importlib.util, "find_spec",
                        lambda name: object() if name in found else None)
    environ = {"JAX_PLATFORMS": platforms} if platforms else {}
    assert xla_flags.gpu_expected(environ) is gpu


def test_auto_adds_the_gpu_set_on_gpus_only_and_the_users_flags_win(monkeypatch):
    environ = {"JAX_PLATFORMS": "cuda",
               "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    added = xla_flags.apply("auto", environ)
    assert added == [f for f in AUTO if "latency_hiding" not in f] and len(added) == len(AUTO) - 1
    assert environ["XLA_FLAGS"].split() == [
        "--xla_gpu_enable_latency_hiding_scheduler=false", *added]
    assert xla_flags.apply("auto", environ) == []  # applying twice adds nothing
    cpu = {"JAX_PLATFORMS": "cpu"}
    assert xla_flags.apply("auto", cpu) == [] and "XLA_FLAGS" not in cpu
    gpu = {"JAX_PLATFORMS": "cuda"}
    assert xla_flags.apply("none", gpu) == [] and "XLA_FLAGS" not in gpu


def test_given_flags_are_checked_and_added_on_any_backend():
    environ = {"JAX_PLATFORMS": "cpu"}
    flags = "--xla_cpu_enable_fast_math=false --xla_gpu_enable_latency_hiding_scheduler=true"
    assert xla_flags.apply(flags, environ) == flags.split()
    assert environ["XLA_FLAGS"] == flags
    with pytest.raises(ConfigError, match="XLA does not know --xla_gpu_no_such_flag=1"):
        xla_flags.apply("--xla_gpu_no_such_flag=1", {"JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("setting", ["fast", "--xla_gpu_x=1 -O3", "", "xla_gpu_x=1"])
def test_a_setting_that_is_not_flags_is_refused(setting):
    with pytest.raises(ConfigError, match="performance.xla_flags="):
        xla_flags.check_setting(setting)
