"""libtpu (installed by the tpu and test extras) stays quiet on a host without a TPU."""

import os
import subprocess
import sys

import pytest

from jaxscale.runtime import tpu_host

START_JAX = "import jax; jax.devices()"


def start_jax(code: str) -> str:
    """stderr of a fresh process that runs `code` with JAX free to look for a TPU."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES")}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True).stderr


@pytest.mark.skipif(tpu_host.is_tpu_vm(), reason="a TPU VM: libtpu finds its own TPU there")
def test_jax_starts_without_libtpus_warnings():
    noisy = start_jax(START_JAX)
    assert "TPU_WORKER_HOSTNAMES" in noisy  # what libtpu prints unprompted (so this can fail)
    # Where the gpu-compile extra is installed too, its CUDA plugin is kept out as the trainer
    # keeps it out (tests/test_cuda_plugin.py).
    assert start_jax("from jaxscale.runtime import cuda_plugin\n"
                     "from jaxscale.runtime.tpu_host import quiet_libtpu\n"
                     "with quiet_libtpu(), cuda_plugin.kept_out(): " + START_JAX) == ""


def test_settings_the_user_made_are_kept_and_ours_are_removed_after(monkeypatch):
    """A child process started after the block (the launchers start `jaxscale.train`) must not
    see TPU_WORKER_HOSTNAMES: it would take itself for a TPU pod's worker."""
    monkeypatch.setattr(tpu_host, "is_tpu_vm", lambda: False)
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    with tpu_host.quiet_libtpu():
        assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8"
        assert os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v6e-8"
    assert "TPU_WORKER_HOSTNAMES" not in os.environ


def test_a_tpu_vm_is_left_alone(monkeypatch):
    monkeypatch.setattr(tpu_host, "is_tpu_vm", lambda: True)
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    with tpu_host.quiet_libtpu():
        assert "TPU_ACCELERATOR_TYPE" not in os.environ
        assert "TPU_WORKER_HOSTNAMES" not in os.environ
