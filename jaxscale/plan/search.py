"""The candidates: every layout of the devices over the mesh axes that the model allows, times
remat policy, gradient accumulation, optimizer-state layout, the step settings the target's
devices choose among (jaxscale/training/step_settings.py: on GPUs the layer loop unrolled and the
logits whole, or not) and, with pipeline stages, schedule and pipeline microbatches, with the
global batch fixed.

Searched: `data`, `fsdp`, `tensor`, `pipeline`, `expert` and `context` inside a slice or node, and
the split of the DCN-connected granules (GPU nodes) over all of them but `tensor`, which stays on
the fast links, where its per-layer collectives belong. Pipelining across granules is what
pipelines are for: only one stage's activations cross the slow network, not every weight (FSDP)
or every gradient (data). With S stages, GPipe is tried with M = 2S and 4S pipeline microbatches
and every accumulation, 1F1B with M = 2S to 16S and none; one layer group per stage
(`pipeline.repeats` 1).

`expert` degrees are searched for models with MoE layers only, those that divide the experts
(`_expert_allowed`); `context` degrees only where the batch cannot take them (`_context_useful`).
Both are pruned before `validate`, so a dense model with short sequences searches what it did
before they existed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping

import ml_collections

from jaxscale.checks import validate
from jaxscale.config import MESH_AXES
from jaxscale.errors import ConfigError
from jaxscale.models.decoder import REMAT_POLICIES
from jaxscale.parallel.pipeline import Pipeline
from jaxscale.training.step_settings import StepSettings, choices

SEARCHED_AXES = ("data", "fsdp", "tensor", "pipeline", "expert", "context")
DCN_AXES = ("data", "fsdp", "pipeline", "expert", "context")
# Pipeline microbatches tried, per stage. GPipe keeps every microbatch's activations until its
# backward, so a larger M costs memory and accumulation (a bubble per part) is what saves it: 2
# (the default) and 4, which halves the bubble. 1F1B keeps at most 2S - 1 in flight, so a larger
# M saves memory and shrinks the bubble, and accumulation would only add bubbles: more M, no
# accumulation.
GPIPE_MICROBATCHES_PER_STAGE = (2, 4)
ONE_F_ONE_B_MICROBATCHES_PER_STAGE = (2, 4, 8, 16)
# Gradient accumulation steps tried (those that divide the batch): each halves the activations
# and adds one more pass of FSDP gathers, so beyond 16 memory is rarely the problem it solves.
MICROBATCHES = (1, 2, 4, 8, 16)
# The fewest tokens of a row a context shard keeps: thinner, the matmuls underfill the chips'
# 128-wide tiles while each layer's key/value all-gather still moves the whole row.
MIN_CONTEXT_TOKENS = 128


def _mesh_shape(ici: tuple, dcn: tuple) -> dict[str, int]:
    """Each mesh axis's size (ICI size x DCN factor), in the mesh's axis order."""
    factors = dict(zip(DCN_AXES, dcn))
    sizes = {a: n * factors.get(a, 1) for a, n in zip(SEARCHED_AXES, ici)}
    return {a: sizes.get(a, 1) for a in MESH_AXES}


@dataclasses.dataclass(frozen=True)
class Candidate:
    ici: tuple[int, ...]  # a size per SEARCHED_AXES inside a slice / node
    dcn: tuple[int, ...]  # a factor per DCN_AXES across slices / nodes
    remat: str
    microbatches: int
    optimizer_state: str  # "params" or "data" (ZeRO-1)
    # With pipeline stages: pipeline.schedule and pipeline.microbatches (M); "" and 0 without.
    schedule: str = ""
    pipeline_microbatches: int = 0
    # The step settings (None: the config's keys as they are), and their place in the devices'
    # order of preference (`step_settings.choices`; 0: the first), which breaks near-ties.
    step: StepSettings | None = None
    step_preference: int = 0

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Each axis's size over the whole mesh (ICI size x DCN factor)."""
        return _mesh_shape(self.ici, self.dcn)

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
        step = f", {self.step.label()}" if self.step else ""
        return (f"{self.mesh_label}{pipelined}, remat {self.remat}, {self.microbatches} "
                f"microbatch(es), optimizer state {self.optimizer_state}{step}")

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
        if self.step:
            flags += [f"--config.model.{k}={v}" for k, v in dataclasses.asdict(self.step).items()]
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
        return self.step.apply(config) if self.step else config

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


def layout(ici: Mapping[str, int], dcn: Mapping[str, int] | None = None) -> tuple[tuple, tuple]:
    """A Candidate's (ici, dcn) tuples from the sizes of the axes above 1, e.g. {"fsdp": 8}."""
    dcn = dcn or {}
    return tuple(ici.get(a, 1) for a in SEARCHED_AXES), tuple(dcn.get(a, 1) for a in DCN_AXES)


def _expert_allowed(config: ml_collections.ConfigDict, degree: int) -> bool:
    """An expert degree above 1 needs MoE layers and experts it divides (validate checks the
    rules and the batch too, more slowly)."""
    moe = config.model.moe
    return degree == 1 or (moe.every > 0 and moe.experts % degree == 0)


def _context_useful(config: ml_collections.ConfigDict, candidate: Candidate) -> bool:
    """Whether the candidate's context degree C can beat data parallelism over the same devices.
    Splitting each row's tokens C ways saves what splitting the rows C more ways saves (the same
    tokens and attention scores per device, the same replicated weights), and adds the all-gather
    of every layer's keys and values. So C > 1 is searched only where a microbatch's rows cannot
    be split C more ways (they are not a multiple of the batch shards times C). The length rule
    must name the axis (else it would only replicate)."""
    shape = candidate.mesh_shape
    degree = shape["context"]
    if degree == 1:
        return True
    rules = config.sharding.rules
    if "context" not in tuple(rules.get("length", ())):
        return False
    rows = config.train.batch_size // candidate.microbatches
    return rows % (math.prod(shape[a] for a in rules.get("batch", ())) * degree) != 0


def _mesh_allowed(config: ml_collections.ConfigDict, ici: tuple, dcn: tuple) -> bool:
    """The cheap checks of a mesh, before any candidate on it is validated."""
    sizes = _mesh_shape(ici, dcn)
    context, seq_len = sizes["context"], config.train.seq_len
    return (config.model.n_layers % sizes["pipeline"] == 0  # stages split the layers
            and _expert_allowed(config, sizes["expert"])
            and (context == 1 or (seq_len % (2 * context) == 0  # the load balance's 2C chunks
                                  and seq_len // context >= MIN_CONTEXT_TOKENS)))


def candidates(config: ml_collections.ConfigDict, num_devices: int, granules: int = 1,
               platform: str = "cpu") -> list[Candidate]:
    """Every candidate that `jaxscale.checks.validate` accepts for `config` on `num_devices`
    devices of `platform` (jax.Device.platform: "cpu", "gpu", "tpu") in `granules`
    DCN-connected slices or nodes, with each of the step settings the devices choose among for
    what the config leaves to them (`step_settings.choices`). ConfigError when there is none, with
    validate's refusal of the plainest layout (every device data-parallel, one microbatch): a
    batch that no layout splits, or a mistake whatever the layout (a LoRA target, a data
    source), which a message about layouts alone would hide."""
    def valid(candidate: Candidate) -> bool:
        try:
            validate(candidate.apply(config), num_devices, granules)
            return True
        except ConfigError:  # a dimension the layout does not divide, a batch it cannot split
            return False

    per_granule = num_devices // granules
    steps = list(enumerate(choices(config, platform)))
    found = []
    for ici, dcn in itertools.product(factorisations(per_granule, len(SEARCHED_AXES)),
                                      factorisations(granules, len(DCN_AXES))):
        if not _mesh_allowed(config, ici, dcn):
            continue
        sizes = _mesh_shape(ici, dcn)
        data_degree, stages = sizes["data"], sizes["pipeline"]
        # Whether ZeRO-1 splits every parameter's moments on this mesh: validate checks it on the
        # model's shapes (slow to build), and it depends on the mesh alone, so once per mesh;
        # None: not asked yet.
        zero1 = None if data_degree > 1 else False
        for microbatches, schedule, m in _schedules(stages):
            candidate = Candidate(ici, dcn, config.model.remat, microbatches, "params", schedule,
                                  m)
            if not _context_useful(config, candidate) or not valid(candidate):
                continue
            layouts = [candidate]
            sharded = dataclasses.replace(candidate, optimizer_state="data")
            if zero1 is None:
                zero1 = valid(sharded)
            if zero1:
                layouts.append(sharded)
            found += [dataclasses.replace(c, remat=r, step=step, step_preference=preference)
                      for c in layouts for r in REMAT_POLICIES for preference, step in steps]
    if not found:
        plain = Candidate((per_granule,) + (1,) * (len(SEARCHED_AXES) - 1),
                          (granules,) + (1,) * (len(DCN_AXES) - 1), config.model.remat, 1, "params")
        try:
            validate(plain.apply(config), num_devices, granules)
        except ConfigError as e:
            raise ConfigError(f"no layout of {num_devices} devices is valid for this config; the "
                              f"plainest, {plain.mesh_label} with 1 microbatch: {e}") from None
    return found
