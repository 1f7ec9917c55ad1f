"""XLA flags for NVIDIA GPUs, set before JAX's backend starts (`performance.xla_flags`).

XLA reads the `XLA_FLAGS` environment variable once, when the first backend initialises, and aborts
the process on a flag it does not know -- on every backend, since all of XLA's flags are parsed
whatever the device. So `apply` must run before anything touches a device, and the "auto" set below
is tested against the installed jaxlib (tests/test_xla_flags.py starts a process with it).

Whether the backend *will* be a GPU is decided without starting it (starting it would read the
flags too early):

  1. `JAX_PLATFORMS` set: a GPU when its first entry (the default backend) is `cuda` or `gpu`;
  2. otherwise: a GPU when a CUDA plugin for jaxlib (`jax_cuda12_plugin`, `jax_cuda13_plugin`, what
     `pip install jax[cuda12]` installs) can be imported. (An installed `libtpu` says nothing: the
     `jaxscale[tpu]` extra installs it on any host to compile for TPUs.)

A wrong guess costs no correctness: the flags are GPU-only options that other backends parse and
ignore; a CUDA plugin on a machine without a GPU only gets them set for nothing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Mapping, MutableMapping

from jaxscale.errors import ConfigError

# (flag, value, why). Sources: the JAX GPU performance tips, NVIDIA JAX-Toolbox's
# "GPU performance" page, and MaxText's GPU recipes (docs/performance.md has the links). Every
# flag exists in jaxlib 0.10 (tests/test_xla_flags.py).
GPU_FLAGS = (
    ("xla_gpu_enable_latency_hiding_scheduler", "true",
     "schedule collectives asynchronously so they overlap with compute"),
    ("xla_gpu_enable_highest_priority_async_stream", "true",
     "run those collectives on a high-priority stream so compute does not starve them"),
    ("xla_gpu_enable_while_loop_double_buffering", "true",
     "unroll the scanned layers by two so one layer's weights arrive while the other computes"),
    ("xla_gpu_enable_pipelined_all_gather", "true",
     "FSDP: gather the next layer's parameters during this layer's forward"),
    ("xla_gpu_enable_pipelined_reduce_scatter", "true",
     "FSDP: reduce-scatter a layer's gradients during the next layer's backward"),
    ("xla_gpu_enable_pipelined_all_reduce", "true",
     "data parallel: all-reduce a layer's gradients during the next layer's backward"),
    ("xla_gpu_all_gather_combine_threshold_bytes", "1073741824",
     "combine a layer's parameter all-gathers into one large transfer (up to 1 GiB)"),
    ("xla_gpu_all_reduce_combine_threshold_bytes", "1073741824",
     "combine gradient all-reduces into large transfers (up to 1 GiB)"),
    ("xla_gpu_reduce_scatter_combine_threshold_bytes", "134217728",
     "combine gradient reduce-scatters (up to 128 MiB: its buffers are temporaries)"),
    ("xla_gpu_enable_all_gather_combine_by_dim", "false",
     "let all-gathers along different dimensions combine too, so the thresholds take effect"),
    ("xla_gpu_enable_reduce_scatter_combine_by_dim", "false",
     "the same for reduce-scatters"),
)
SETTINGS = ("auto", "none")
_FLAG = re.compile(r"--(xla_[a-z0-9_]+)(=\S*)?")
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
_GPU_PLATFORMS = ("cuda", "gpu")


def check_setting(setting: str) -> None:
    """ConfigError unless `setting` is auto, none, or a string of --xla_NAME[=VALUE] flags. Whether
    XLA knows each flag is checked by `check_known` (it needs a process of its own)."""
    if setting in SETTINGS:
        return
    if not str(setting).strip():
        raise ConfigError("performance.xla_flags='' is empty; use 'auto', 'none', or flags "
                          "written --xla_NAME=VALUE separated by spaces")
    bad = [token for token in str(setting).split() if not _FLAG.fullmatch(token)]
    if bad:
        raise ConfigError(f"performance.xla_flags={setting!r}: {bad[0]!r} is not an XLA flag; "
                          "use 'auto', 'none', or flags written --xla_NAME=VALUE separated by "
                          "spaces")


def gpu_expected(environ: Mapping[str, str]) -> bool:
    """Whether JAX's default backend will be an NVIDIA GPU (the rule in the module docstring)."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() in _GPU_PLATFORMS
    return any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


def flag_names(flags: str) -> set[str]:
    return {m.group(1) for m in _FLAG.finditer(flags)}


def flags_to_add(setting: str, environ: Mapping[str, str]) -> list[str]:
    """The flags `setting` adds to XLA_FLAGS: the GPU set on GPUs for "auto", the given ones for
    a flags string; none that XLA_FLAGS already names (the user's environment wins)."""
    if setting == "none" or (setting == "auto" and not gpu_expected(environ)):
        return []
    wanted = ([f"--{name}={value}" for name, value, _ in GPU_FLAGS] if setting == "auto"
              else setting.split())
    present = flag_names(environ.get("XLA_FLAGS", ""))
    return [flag for flag in wanted if _FLAG.fullmatch(flag).group(1) not in present]


def check_known(flags: list[str]) -> None:
    """ConfigError naming the first of `flags` that this jaxlib's XLA does not know. XLA can only
    tell by aborting, so a short-lived CPU process is asked."""
    if not flags:
        return
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                            capture_output=True, text=True)
    if result.returncode == 0:
        return
    unknown = re.search(r"Unknown flags? in XLA_FLAGS: (\S+)", result.stderr)
    what = f"XLA does not know {unknown.group(1)}" if unknown else \
        f"XLA failed to start with them ({' '.join(result.stderr.split()[-20:])})"
    raise ConfigError(f"performance.xla_flags={' '.join(flags)!r}: {what}; fix the flag's name "
                      "(the flags of this jaxlib are in XLA's debug_options_flags.cc) or drop it")


def apply(setting: str, environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Adds the flags of `setting` to `environ["XLA_FLAGS"]` and returns them. Call it before JAX
    starts a backend: later, XLA has read its flags already."""
    check_setting(setting)
    flags = flags_to_add(setting, environ)
    if setting not in SETTINGS:
        check_known(flags)
    if flags:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", ""), *flags]).strip()
    return flags
