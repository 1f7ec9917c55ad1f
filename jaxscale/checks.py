"""A config checked whole, for the devices it will run on, before anything is compiled or written.

    ici, dcn = validate(config, num_devices, num_slices)   # ConfigError on the first problem
    mesh = checked_mesh(config, devices)                  # the same, then the devices' own checks

config.py checks the schema and the rules between its own values; each component checks its own
section (the model's family, remat and attention names, the data, the profile window, the XLA
flags, the optimizer's memory options, the pipeline, experts, context and sharding rules against
the mesh).
This module only composes them, in the order a user fixes them: it sits above every component it
names, so that config.py imports none of them.
"""

from __future__ import annotations

import types

import ml_collections
from jax.sharding import Mesh

from jaxscale.config import MESH_AXES, check_settings
from jaxscale.data import check_data
from jaxscale.errors import ConfigError
from jaxscale.inference.samples import check_samples
from jaxscale.models import family
from jaxscale.models.decoder import REMAT_POLICIES
from jaxscale.models.fp8 import check_fp8
from jaxscale.models.lora import check_lora
from jaxscale.models.rope import check_head_dim
from jaxscale.observe.profiling import check_window
from jaxscale.observe.trackers import check_trackers
from jaxscale.parallel.attention import IMPLEMENTATIONS, check_attention
from jaxscale.parallel.context import check_context
from jaxscale.parallel.experts import check_experts
from jaxscale.parallel.mesh import asks_for_dcn, build_mesh, dcn_granules, resolve_mesh_shape
from jaxscale.parallel.pipeline import check_pipeline
from jaxscale.parallel.sharding import check_rules
from jaxscale.runtime.xla_flags import check_setting
from jaxscale.training import offload
from jaxscale.training.elastic import fitted
from jaxscale.training.layout import check_optimizer_layout
from jaxscale.training.optim import check_memory_options
from jaxscale.training.state import logical_axis_sizes


def validate(config: ml_collections.ConfigDict, num_devices: int, num_slices: int = 1
             ) -> tuple[dict[str, int], dict[str, int]]:
    """Raises ConfigError on the first problem in `config` for a run on `num_devices` devices in
    `num_slices` DCN-connected granules; returns the mesh's (ici, dcn) axis sizes."""
    check_settings(config)
    family(config.model.name)  # ConfigError for a model.name that names no family
    check_head_dim(config.model.head_dim)
    # Then each component its own section, from the samples and the data down to the mesh's axes.
    check_samples(config)
    check_data(config)
    check_memory_options(config.optim)
    sizes = logical_axis_sizes(config)
    check_lora(config)
    check_window(config.profile, config.train.steps)
    check_trackers(config)
    m = config.model
    if m.remat not in REMAT_POLICIES:
        raise ConfigError(f"model.remat={m.remat!r} is unknown; use one of "
                          f"{tuple(REMAT_POLICIES)}")
    if m.attention not in IMPLEMENTATIONS:
        raise ConfigError(f"model.attention={m.attention!r} is unknown; use one of "
                          f"{IMPLEMENTATIONS}")
    check_setting(config.performance.xla_flags)
    ici, dcn = resolve_mesh_shape(config.mesh, num_devices, num_slices)
    mesh_shape = {a: ici[a] * dcn[a] for a in MESH_AXES}
    check_optimizer_layout(config, mesh_shape)
    check_pipeline(config, mesh_shape)  # first of the axes: its errors name the pipeline's keys
    check_experts(config, mesh_shape)
    check_context(config, mesh_shape)
    check_rules(config.sharding.rules, mesh_shape, sizes)
    return ici, dcn


def checked_mesh(config: ml_collections.ConfigDict, devices: list) -> Mesh:
    """The mesh `config` runs on over `devices`, once the config is checked whole for them
    (`validate`) and for their kind: fp8 matmuls, the attention kernel, host offload."""
    ici, dcn = validate(config, len(devices), dcn_granules(config.mesh, devices))
    check_fp8(config.precision.matmul, devices[0])
    check_attention(config, devices[0])
    if config.optim.offload_state:
        offload.check_supported(devices)
    return build_mesh(ici, dcn, devices)


# --- an elastic range's counts: the refit (training/elastic.py) checked ---------------------------


def idle_devices(config: ml_collections.ConfigDict, devices: int, per_host: int,
                 full_devices: int) -> int:
    """How many of `devices` (`per_host` on each host) the run, refitted for them from
    `full_devices`, leaves idle. Raises ConfigError when the refitted config cannot run on them."""
    hosts = [types.SimpleNamespace(platform="host", process_index=i // per_host)
             for i in range(devices)]
    fit, used, _ = fitted(config, hosts, full_devices)
    granules = len({d.process_index for d in used}) if asks_for_dcn(config.mesh) else 1
    validate(fit, len(used), granules)
    return devices - len(used)


def runs_on(config: ml_collections.ConfigDict, hosts: int, per_host: int, full_hosts: int) -> bool:
    """Whether the run, written for `full_hosts` hosts of `per_host` devices, runs on `hosts` of
    them with none of their devices all idle."""
    try:
        return idle_devices(config, hosts * per_host, per_host, full_hosts * per_host) < per_host
    except ConfigError:
        return False
