"""JAX's CUDA plugin (the gpu-compile extra) stays out of runs on a host without NVIDIA GPUs: JAX
starts there as it would without the plugin, and nothing changes where there is a driver, a TPU,
or a choice of platforms the user made."""

import os
import subprocess
import sys

import jax
import pytest

from jaxscale.runtime import cuda_plugin, tpu_host
from jaxscale.trainer import Trainer
from tests.helpers import small_config

START_JAX = "import jax; jax.devices()"


def start_jax(code: str) -> str:
    """stderr of a fresh process that runs `code` with JAX free to choose its platforms."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True).stderr


NO_GPU_HOST_WITH_THE_PLUGIN = pytest.mark.skipif(
    not cuda_plugin.installed() or cuda_plugin.has_nvidia_driver() or tpu_host.is_tpu_vm(),
    reason="needs JAX's CUDA plugin on a host without NVIDIA GPUs or TPUs")


@NO_GPU_HOST_WITH_THE_PLUGIN
def test_jax_starts_without_the_plugins_traceback():
    quiet = ("from jaxscale.runtime import cuda_plugin\n"
             "from jaxscale.runtime.tpu_host import quiet_libtpu\n"
             "with quiet_libtpu(), cuda_plugin.kept_out(): " + START_JAX)
    assert "xla_cuda" in start_jax("from jaxscale.runtime.tpu_host import quiet_libtpu\n"
                                   "with quiet_libtpu(): " + START_JAX)  # so this can fail
    assert start_jax(quiet) == ""


@pytest.mark.slow
@NO_GPU_HOST_WITH_THE_PLUGIN
def test_the_commands_that_read_a_run_start_jax_without_the_plugins_traceback(tmp_path):
    """As `jaxscale.train` does (above): export_hf printed the plugin's cuInit traceback over its
    own line."""
    config = small_config()
    config.train.steps = 1
    config.checkpoint.compilation_cache = False
    Trainer(config, str(tmp_path / "run"), devices=jax.devices()[:1]).run()
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    for module, *flags in (("jaxscale.export_hf", f"--out={tmp_path}/hf"),
                           ("jaxscale.sample", "--prompt=def ", "--max_new_tokens=2")):
        result = subprocess.run([sys.executable, "-m", module, f"--workdir={tmp_path}/run", *flags],
                                env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "cuInit" not in result.stderr and "Traceback" not in result.stderr, \
            (module, result.stderr)


@pytest.mark.parametrize("installed, driver, tpu, chosen, kept_out", [
    (True, False, False, None, True),
    (False, False, False, None, False),  # nothing to keep out
    (True, True, False, None, False),  # a GPU host: the plugin is its backend
    (True, False, True, None, False),  # a TPU VM: its own platform, untouched
    (True, False, False, "cpu", False),  # the user chose the platforms
])
def test_only_a_plugin_with_nothing_to_drive_is_kept_out(monkeypatch, installed, driver, tpu,
                                                          chosen, kept_out):
    monkeypatch.setattr(cuda_plugin, "installed", lambda: installed)
    monkeypatch.setattr(cuda_plugin, "has_nvidia_driver", lambda: driver)
    monkeypatch.setattr(cuda_plugin, "is_tpu_vm", lambda: tpu)
    before = jax.config.jax_platforms
    try:
        jax.config.update("jax_platforms", chosen)
        with cuda_plugin.kept_out():
            assert jax.config.jax_platforms == ("cpu" if kept_out else chosen)
        assert jax.config.jax_platforms == chosen
    finally:
        jax.config.update("jax_platforms", before)


def test_a_driver_is_seen_by_its_device_nodes(tmp_path):
    assert not cuda_plugin.has_nvidia_driver([str(tmp_path / "nvidiactl")])
    (tmp_path / "nvidiactl").touch()
    assert cuda_plugin.has_nvidia_driver([str(tmp_path / "nvidiactl")])
