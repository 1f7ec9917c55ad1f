"""The candidates: every layout of the devices over the mesh axes that the model allows, times
remat policy, gradient accumulation and optimizer-state layout, with the global batch fixed.

Searched: `data`, `fsdp`, `tensor` inside a slice or node, and the split of the DCN-connected
granules (GPU nodes) over `data` and `fsdp`; tensor parallelism stays on the fast links, where
its per-layer collectives belong. `pipeline` stays 1 until pipeline parallelism is implemented.
"""

from __future__ import annotations

import dataclasses
import itertools

import ml_collections

from jaxscale.config import validate
from jaxscale.errors import ConfigError
from jaxscale.models import REMAT_POLICIES

SEARCHED_AXES = ("data", "fsdp", "tensor")
DCN_AXES = ("data", "fsdp")
# Gradient accumulation steps tried (those that divide the batch): each halves the activations
# and adds one more pass of FSDP gathers, so beyond 16 memory is rarely the problem it solves.
MICROBATCHES = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Candidate:
    ici: tuple[int, int, int]  # data, fsdp, tensor inside a slice / node
    dcn: tuple[int, int]  # data, fsdp across slices / nodes
    remat: str
    microbatches: int
    optimizer_state: str  # "params" or "data" (ZeRO-1)

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Each axis's size over the whole mesh (ICI size x DCN factor)."""
        dcn = dict(zip(DCN_AXES, self.dcn))
        return {a: n * dcn.get(a, 1) for a, n in zip(SEARCHED_AXES, self.ici)} | {"pipeline": 1}

    @property
    def mesh_label(self) -> str:
        label = " ".join(f"{a}={n}" for a, n in zip(SEARCHED_AXES, self.ici) if n > 1) or "1 device"
        dcn = " ".join(f"dcn.{a}={n}" for a, n in zip(DCN_AXES, self.dcn) if n > 1)
        return f"{label} {dcn}".strip()

    @property
    def axes_used(self) -> int:
        """How many axes split the devices: the simpler mesh wins a near-tie."""
        return sum(n > 1 for n in (*self.ici, *self.dcn))

    def overrides(self) -> list[str]:
        """The `--config.KEY=VALUE` flags that make a config run this candidate."""
        flags = [f"--config.mesh.{a}={n}" for a, n in zip(SEARCHED_AXES, self.ici)]
        flags += ["--config.mesh.pipeline=1", "--config.mesh.auto=False"]
        flags += [f"--config.mesh.dcn.{a}={n}" for a, n in zip(DCN_AXES, self.dcn)]
        flags += [f"--config.model.remat={self.remat}",
                  f"--config.train.microbatches={self.microbatches}",
                  f"--config.sharding.optimizer_state={self.optimizer_state}"]
        return flags

    def apply(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of `config` set to run this candidate."""
        config = config.copy_and_resolve_references()
        # auto=False: the candidate is a layout already (the planner compiles it as a run).
        config.mesh.update(dict(zip(SEARCHED_AXES, self.ici)), pipeline=1, auto=False)
        config.mesh.dcn.update(dict(zip(DCN_AXES, self.dcn)), tensor=1, pipeline=1)
        config.model.remat = self.remat
        config.train.microbatches = self.microbatches
        config.sharding.optimizer_state = self.optimizer_state
        return config


def factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `n`."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in factorisations(n // d, parts - 1)]


def candidates(config: ml_collections.ConfigDict, num_devices: int,
               granules: int = 1) -> list[Candidate]:
    """Every candidate that `jaxscale.config.validate` accepts for `config` on `num_devices`
    devices in `granules` DCN-connected slices or nodes."""
    per_granule = num_devices // granules
    found = []
    for ici, dcn in itertools.product(factorisations(per_granule, 3),
                                      factorisations(granules, 2)):
        data_degree = ici[0] * dcn[0]
        for microbatches, layout in itertools.product(
                MICROBATCHES, ("params", "data") if data_degree > 1 else ("params",)):
            candidate = Candidate(ici, dcn, config.model.remat, microbatches, layout)
            try:
                validate(candidate.apply(config), num_devices, granules)
            except ConfigError:
                continue  # a dimension the layout does not divide, or a batch it cannot split
            found += [dataclasses.replace(candidate, remat=r) for r in REMAT_POLICIES]
    return found
