"""The candidates: every layout of the devices over the mesh axes that the model allows, times
remat policy, gradient accumulation, optimizer-state layout and, with pipeline stages, schedule
and pipeline microbatches, with the global batch fixed.

Searched: `data`, `fsdp`, `tensor`, `pipeline` inside a slice or node, and the split of the
DCN-connected granules (GPU nodes) over `data`, `fsdp` and `pipeline`; tensor parallelism stays on
the fast links, where its per-layer collectives belong. Pipelining across granules is what
pipelines are for: only one stage's activations cross the slow network, not every weight (FSDP)
or every gradient (data). With S stages, GPipe is tried with M = 2S and 4S pipeline microbatches
and every accumulation, 1F1B with M = 2S to 16S and none; one layer group per stage
(`pipeline.repeats` 1).
"""

from __future__ import annotations

import dataclasses
import itertools

import ml_collections

from jaxscale.config import MESH_AXES, validate
from jaxscale.errors import ConfigError
from jaxscale.models import REMAT_POLICIES
from jaxscale.parallel.pipeline import Pipeline

SEARCHED_AXES = ("data", "fsdp", "tensor", "pipeline")
DCN_AXES = ("data", "fsdp", "pipeline")
# Pipeline microbatches tried, per stage. GPipe keeps every microbatch's activations until its
# backward, so a larger M costs memory and accumulation (a bubble per part) is what saves it: 2
# (the default) and 4, which halves the bubble. 1F1B keeps at most 2S - 1 in flight, so a larger
# M saves memory and shrinks the bubble, and accumulation would only add bubbles: more M, no
# accumulation.
GPIPE_MICROBATCHES_PER_STAGE = (2, 4)
ONE_F_ONE_B_MICROBATCHES_PER_STAGE = (2, 4, 8, 16)
# Under the stages' vmap every weight matmul has the stage as a batch dimension, so `save_dots`
# (dots_with_no_batch_dims_saveable) saves none of them: it is `full` there, not searched twice.
PIPELINE_REMAT = ("none", "full")
# Gradient accumulation steps tried (those that divide the batch): each halves the activations
# and adds one more pass of FSDP gathers, so beyond 16 memory is rarely the problem it solves.
MICROBATCHES = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Candidate:
    ici: tuple[int, int, int, int]  # data, fsdp, tensor, pipeline inside a slice / node
    dcn: tuple[int, int, int]  # data, fsdp, pipeline across slices / nodes
    remat: str
    microbatches: int
    optimizer_state: str  # "params" or "data" (ZeRO-1)
    # With pipeline stages: pipeline.schedule and pipeline.microbatches (M); "" and 0 without.
    schedule: str = ""
    pipeline_microbatches: int = 0

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Each axis's size over the whole mesh (ICI size x DCN factor)."""
        dcn = dict(zip(DCN_AXES, self.dcn))
        sizes = {a: n * dcn.get(a, 1) for a, n in zip(SEARCHED_AXES, self.ici)}
        return {a: sizes.get(a, 1) for a in MESH_AXES}  # in the mesh's axis order

    @property
    def mesh_label(self) -> str:
        label = " ".join(f"{a}={n}" for a, n in zip(SEARCHED_AXES, self.ici) if n > 1) or "1 device"
        dcn = " ".join(f"dcn.{a}={n}" for a, n in zip(DCN_AXES, self.dcn) if n > 1)
        return f"{label} {dcn}".strip()

    @property
    def pipeline(self) -> Pipeline | None:
        """The pipeline schedule over the stages, or None without pipelining."""
        stages = self.mesh_shape["pipeline"]
        return Pipeline(stages, self.pipeline_microbatches, 1, self.schedule) if stages > 1 \
            else None

    @property
    def pipeline_label(self) -> str:
        p = self.pipeline
        return f"{p.schedule} M={p.num_microbatches}" if p else "-"

    def summary(self) -> str:
        """The candidate in words, for the planner's log and its `chosen:` line."""
        p = self.pipeline
        pipelined = (f", {p.schedule} over {p.num_microbatches} pipeline microbatches (bubble "
                     f"{p.bubble_fraction():.1%})" if p else "")
        return (f"{self.mesh_label}{pipelined}, remat {self.remat}, {self.microbatches} "
                f"microbatch(es), optimizer state {self.optimizer_state}")

    @property
    def axes_used(self) -> int:
        """How many axes split the devices: the simpler mesh wins a near-tie."""
        return sum(n > 1 for n in (*self.ici, *self.dcn))

    def overrides(self) -> list[str]:
        """The `--config.KEY=VALUE` flags that make a config run this candidate."""
        ici, dcn = self.sizes()
        flags = [f"--config.mesh.{a}={n}" for a, n in ici.items()]
        flags += ["--config.mesh.auto=False"]
        flags += [f"--config.mesh.dcn.{a}={n}" for a, n in dcn.items()]
        flags += [f"--config.model.remat={self.remat}",
                  f"--config.train.microbatches={self.microbatches}",
                  f"--config.sharding.optimizer_state={self.optimizer_state}"]
        if self.pipeline:
            flags += [f"--config.pipeline.{k}={v}" for k, v in self._pipeline_keys().items()]
        return flags

    def apply(self, config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
        """A copy of `config` set to run this candidate."""
        config = config.copy_and_resolve_references()
        ici, dcn = self.sizes()
        # auto=False: the candidate is a layout already (the planner compiles it as a run).
        config.mesh.update(ici, auto=False)
        config.mesh.dcn.update(dcn)
        config.model.remat = self.remat
        config.train.microbatches = self.microbatches
        config.sharding.optimizer_state = self.optimizer_state
        if self.pipeline:
            config.pipeline.update(self._pipeline_keys())
        return config

    def sizes(self) -> tuple[dict[str, int], dict[str, int]]:
        """(ICI, DCN) size of every mesh axis, in the mesh's order: the axes not searched are 1."""
        ici = dict(zip(SEARCHED_AXES, self.ici))
        dcn = dict(zip(DCN_AXES, self.dcn))
        return {a: ici.get(a, 1) for a in MESH_AXES}, {a: dcn.get(a, 1) for a in MESH_AXES}

    def _pipeline_keys(self) -> dict:
        return dict(schedule=self.schedule, microbatches=self.pipeline_microbatches, repeats=1)


def factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `n`."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0
            for rest in factorisations(n // d, parts - 1)]


def _schedules(stages: int) -> list[tuple[int, str, int]]:
    """(train.microbatches, pipeline.schedule, pipeline.microbatches) to try with `stages`."""
    if stages == 1:
        return [(k, "", 0) for k in MICROBATCHES]
    return ([(k, "gpipe", n * stages) for k in MICROBATCHES
             for n in GPIPE_MICROBATCHES_PER_STAGE]
            + [(1, "1f1b", n * stages) for n in ONE_F_ONE_B_MICROBATCHES_PER_STAGE])


def candidates(config: ml_collections.ConfigDict, num_devices: int,
               granules: int = 1) -> list[Candidate]:
    """Every candidate that `jaxscale.config.validate` accepts for `config` on `num_devices`
    devices in `granules` DCN-connected slices or nodes."""
    def valid(candidate: Candidate) -> bool:
        try:
            validate(candidate.apply(config), num_devices, granules)
            return True
        except ConfigError:  # a dimension the layout does not divide, a batch it cannot split
            return False

    per_granule = num_devices // granules
    found = []
    for ici, dcn in itertools.product(factorisations(per_granule, len(SEARCHED_AXES)),
                                      factorisations(granules, len(DCN_AXES))):
        if config.model.n_layers % (ici[3] * dcn[2]):
            continue  # the stages must split the layers: validate says so too, more slowly
        data_degree, stages = ici[0] * dcn[0], ici[3] * dcn[2]
        # Whether ZeRO-1 splits every parameter's moments on this mesh: validate checks it on the
        # model's shapes (slow to build), and it depends on the mesh alone, so once per mesh;
        # None: not asked yet.
        zero1 = None if data_degree > 1 else False
        for microbatches, schedule, m in _schedules(stages):
            candidate = Candidate(ici, dcn, config.model.remat, microbatches, "params", schedule,
                                  m)
            if not valid(candidate):
                continue
            layouts = [candidate]
            sharded = dataclasses.replace(candidate, optimizer_state="data")
            if zero1 is None:
                zero1 = valid(sharded)
            if zero1:
                layouts.append(sharded)
            found += [dataclasses.replace(c, remat=r) for c in layouts
                      for r in (REMAT_POLICIES if stages == 1 else PIPELINE_REMAT)]
    return found
