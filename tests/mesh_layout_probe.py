"""Run under `jaxscale.launch.local --module=tests.mesh_layout_probe -- <training flags>`: builds
the training mesh as the trainer does and prints, for each mesh axis and each index along it, the
hosts that hold its devices (tests/test_layouts.py checks that each ICI group sits on one host)."""

import json
import sys

from jaxscale.cli import parse_train_flags
from jaxscale.runtime import distributed

config, _ = parse_train_flags(sys.argv)
distributed.initialize(config.distributed.init_timeout_s, config.distributed.heartbeat_timeout_s)

import jax  # noqa: E402 - after joining the cluster
import numpy as np  # noqa: E402

from jaxscale.checks import validate  # noqa: E402
from jaxscale.parallel.mesh import build_mesh, dcn_granules  # noqa: E402

devices = jax.devices()
mesh = build_mesh(*validate(config, len(devices), dcn_granules(config.mesh, devices)), devices)
for axis in mesh.axis_names:
    along = list(mesh.axis_names).index(axis)
    groups = [sorted({d.process_index for d in np.ravel(group)})
              for group in np.moveaxis(mesh.devices, along, 0)]
    print(f"hosts by {axis} index:", json.dumps(groups), flush=True)
