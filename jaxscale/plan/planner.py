"""The planner: search the candidates, prune them with the memory model, compile the most promising
for the target, keep those that fit, and choose by estimated step time.

    plan = make_plan(config, parse_target("v5p-64"), top=3)
    plan.chosen.candidate.overrides()   # the --config flags that run it

Steps: (1) `search.candidates` lists every layout `checks.validate` accepts; (2) each gets the
analytic memory estimate and step time; (3) the `top` fastest whose estimate fits in
`FIT_FRACTION` of the chip's memory are compiled ahead of time for the target's devices (abstract
inputs, nothing allocated) and judged by the compiler's own bytes per device and the collectives
in their HLO, their step time gaining the memory traffic of the program (rank.py); when none of
them fits, the next ones are compiled, up to `top` more; (4) the fastest compiled candidate that
fits is chosen, the simpler one on a near-tie. GPU targets have no compiler here: steps (3)-(4)
use the estimates, without memory traffic, and the report says so.

When the compiled candidates are to be timed (`spread=True`, what `mesh.auto` does with
`mesh.auto_trials` > 1), step (3) compiles a spread of distinct mesh shapes first: of the
candidates estimated within `TIMING_TIE` of the fastest, the best-ranked one of each mesh, in the
order `spread_order` gives (the fastest first, then each time the mesh farthest from those
already taken); then, as before, the rest in ranked order, one per mesh and remat policy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Callable

import jax
import ml_collections

from jaxscale.models.spec import model_spec
from jaxscale.observe.device_memory import StepMemory
from jaxscale.parallel.attention import auto_kernel, packed_layout_bound
from jaxscale.parallel.mesh import MeshLayoutError
from jaxscale.plan import rank
from jaxscale.plan.collectives import Collective, parse_collectives
from jaxscale.plan.compiled import compile_train_step, refused_by_xla
from jaxscale.plan.memory_model import MemoryEstimate, estimate_memory
from jaxscale.plan.search import Candidate, candidates, layout
from jaxscale.plan.targets import Target, target_devices
from jaxscale.plan.traffic import bytes_accessed
from jaxscale.runtime.chips import GIB, Chip
from jaxscale.training.step_settings import StepSettings, choices

FIT_FRACTION = 0.9  # of the chip's memory: the rest is the runtime's, fragmentation, the input
# Candidates whose estimated step time is within this fraction of the fastest's are near-ties for
# timing: the model cannot be trusted to order them. It has been wrong by more: on one H100 a
# layout it put 3% ahead ran 6% behind; on 8 CPU devices it puts the configs/tiny.py meshes
# without pipeline stages within 5% of each other, and they ran up to 1.2 times apart
# (docs/planning.md).
TIMING_TIE = 0.10
# CPUs have no chip entry: their times are computed at these nominal rates, good for ranking only.
NOMINAL_CPU = Chip("CPU (nominal)", 0, 1e12, 100e9, 100e9, 10e9, "memory", 1)


@dataclasses.dataclass
class Row:
    """One candidate as the planner judged it."""
    candidate: Candidate
    estimate: MemoryEstimate
    # The collectives and the step time they give: from the compiled HLO once compiled, else
    # counted from the model's shapes (rank.analytic_collectives).
    collectives: list[Collective]
    time: rank.StepTime
    compiled: StepMemory | None = None
    # The compiled step itself: `mesh.auto` trains with the chosen one instead of compiling it
    # again (jaxscale/plan/auto.py).
    executable: jax.stages.Compiled | None = None
    compile_seconds: float | None = None
    error: str | None = None  # the compiler's, when it refused (e.g. out of memory)
    role: str = ""  # "" (searched), or why it is shown: "pure data", "FSDP only"

    @property
    def bytes(self) -> int:
        """The compiler's bytes per device when compiled, else the estimate."""
        return self.compiled.total if self.compiled else self.estimate.total


@dataclasses.dataclass
class Plan:
    target: Target
    chip: Chip
    capacity: int | None  # bytes per device; None: unknown (CPUs without --hbm_gib)
    rows: list[Row]  # compiled rows first (fastest first), then the reference rows
    chosen: Row | None
    searched: int  # candidates considered
    seconds: float  # planning time
    smallest: Row  # the candidate with the smallest estimate, for saying by how much none fits

    @property
    def budget(self) -> float:
        return FIT_FRACTION * self.capacity if self.capacity else float("inf")

    def fits(self, row: Row) -> bool:
        return row.error is None and row.bytes <= self.budget

    def verdict(self, row: Row) -> str:
        if row is self.chosen:
            return "chosen"
        if row.error:
            return "compile failed"
        fits = "fits" if self.fits(row) else "too big"
        return fits if row.compiled else f"{fits} (estimate)"


def _attention(config: ml_collections.ConfigDict, target: Target,
               mesh_shape: Mapping[str, int]) -> tuple[str, int]:
    """(the attention kernel a run of `config` on `target` with `mesh_shape` uses, the bound
    cuDNN's packed layout runs with): as jaxscale/parallel/attention.py decides at run time,
    from the target's chip instead of its devices."""
    a, chip = config.model.attention, target.chip
    platform = "cpu" if chip is None else "tpu" if chip.name.startswith("TPU") else "gpu"
    capability = chip.compute_capability if chip else ""
    split = mesh_shape["context"] > 1
    if a == "auto":
        a = auto_kernel(platform, capability, config.precision.compute_dtype,
                        config.train.seq_len, config.model.head_dim, packed=True,
                        max_segments=config.data.max_segments, split=split,
                        pipelined=mesh_shape["pipeline"] > 1)
    if a == "splash" and split:  # refused by validate; the XLA path's memory, to be safe
        a = "xla"
    bound = packed_layout_bound(capability, config.data.max_segments, split) if a == "cudnn" \
        else 0
    return a, bound


def _reference(rows: dict[Candidate, Row], config, role: str, axis: str, devices: int,
               granules: int, step: StepSettings) -> Row | None:
    """The row of a familiar layout (pure data, FSDP only: all of a granule's devices on `axis`,
    the granules too), with the config's remat, the devices' first `step` settings and no
    accumulation, to show beside the choice; None when the model does not allow it."""
    wanted = Candidate(*layout({axis: devices // granules}, {axis: granules}),
                       config.model.remat, 1, "params", step=step)
    row = rows.get(wanted)
    return dataclasses.replace(row, role=role) if row else None


def make_plan(config: ml_collections.ConfigDict, target: Target, *, top: int = 3,
              capacity: int | None = None, compile_references: bool = False, devices=None,
              spread: bool = False, log: Callable[[str], None] = lambda line: None
              ) -> Plan:
    """Plans `config` for `target`; `capacity` overrides the chip's memory per device (bytes).
    `compile_references`: also compile the pure-data and FSDP-only rows that the estimate fits
    (for comparisons). `devices`: compile for these (default: the target's). `spread`: the
    compiled candidates are to be timed, so compile different layouts: first distinct mesh
    shapes among the near-ties (`spread_order`), then no second candidate of a mesh and remat
    policy that already fits, one differing only in accumulation or optimizer-state layout
    (which the step-time model rarely tells apart). Either way `top` are compiled, and up to
    `top` more only while none of those fits."""
    start = time.perf_counter()
    chip = target.chip or NOMINAL_CPU
    capacity = capacity or (chip.hbm_bytes if target.chip else None)
    budget = FIT_FRACTION * capacity if capacity else float("inf")
    n, granules = target.num_devices, target.granules
    spec = model_spec(config)
    platform = target.device_platform
    found = candidates(config, n, granules, platform)
    rows = {}
    for c in found:
        c_config = c.apply(config)
        collectives = rank.analytic_collectives(c_config, spec, c, granules)
        memory = estimate_memory(c_config, spec, c.mesh_shape,
                                 *_attention(c_config, target, c.mesh_shape))
        rows[c] = Row(c, memory, collectives, rank.step_time(c_config, spec, c, collectives,
                                                             chip, n))
    # What happens next: without a compiler for the target, the estimates alone choose.
    judge = ("compiling the fastest" if target.compiles
             else "choosing, from the estimates alone (nothing compiled), the fastest")
    log(f"{len(found)} candidates; {judge} that the estimate fits in {budget / GIB:.3g} GiB per "
        "device" if capacity else f"{len(found)} candidates")
    by_speed = sorted(rows.values(), key=lambda r: (r.time.total, rank.simplicity(r.candidate)))
    promising = [r for r in by_speed if r.estimate.total <= budget]
    first_step = choices(config, platform)[0]
    references = [r for r in (
        _reference(rows, config, "pure data", "data", n, granules, first_step),
        _reference(rows, config, "FSDP only", "fsdp", n, granules, first_step)) if r]

    judged: dict[Candidate, Row] = {}  # compiled (or, for GPUs, the estimates' best)
    if target.compiles:
        devices = devices if devices is not None else target_devices(target)
        order = promising
        if spread and promising:
            order = spread_order(promising)
            tied = len({_mesh(r.candidate) for r in near_ties(promising)})
            log(f"{tied} mesh shapes estimated within {TIMING_TIE:.0%} of the fastest: "
                f"compiling a spread of them to time, {top} at most" if tied > 1 else
                f"one mesh shape estimated within {TIMING_TIE:.0%} of the fastest: compiling "
                f"its best-ranked candidates to time, {top} at most")
        for row in order:
            fitting = [r for r in judged.values() if r.error is None and r.bytes <= budget]
            if len(judged) >= top and (fitting or len(judged) >= 2 * top):
                break
            if spread and _layout(row.candidate) in {_layout(r.candidate) for r in fitting}:
                continue
            judged[row.candidate] = _compile(row, config, devices, chip, log)
        for ref in references if compile_references else ():
            if ref.candidate not in judged and ref.estimate.total <= budget:
                judged[ref.candidate] = _compile(ref, config, devices, chip, log)
    else:
        judged = {r.candidate: r for r in promising[:top]}
    plan = Plan(target, chip, capacity, [], None, len(found), 0.0,
                smallest=min(rows.values(), key=lambda r: r.estimate.total))
    fitting = [r for r in judged.values() if plan.fits(r)]
    plan.chosen = rank.best(fitting) if fitting else None
    for ref in references:  # shown with their role, compiled or as estimated
        judged[ref.candidate] = dataclasses.replace(judged.get(ref.candidate, ref), role=ref.role)
        if plan.chosen and plan.chosen.candidate == ref.candidate:
            plan.chosen = judged[ref.candidate]
    plan.rows = sorted(judged.values(), key=lambda r: (bool(r.role) and not r.compiled,
                                                       r.time.total))
    plan.seconds = time.perf_counter() - start
    return plan


def _layout(c: Candidate) -> Candidate:
    """`c` with one accumulation step and the optimizer state with the parameters."""
    return dataclasses.replace(c, microbatches=1, optimizer_state="params")


def _mesh(c: Candidate) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`c`'s mesh shape: its axes' sizes inside a slice or node and across them."""
    return c.ici, c.dcn


def mesh_distance(a: Candidate, b: Candidate) -> float:
    """How far apart two mesh shapes are: the sum over the axes (inside and across slices or
    nodes) of |log2 of the ratio of their sizes|: twice the factors of 2 of the devices moved
    from one axis to another. fsdp=8 to data=8: 6; fsdp=8 to fsdp=4 tensor=2: 2; equal: 0."""
    return sum(abs(math.log2(x) - math.log2(y))
               for x, y in zip((*a.ici, *a.dcn), (*b.ici, *b.dcn)))


def near_ties(ranked: list[Row]) -> list[Row]:
    """The rows of `ranked` (fastest first) whose estimated step time is within `TIMING_TIE`
    of the first's."""
    if not ranked:
        return []
    limit = ranked[0].time.total * (1 + TIMING_TIE)
    return [r for r in ranked if r.time.total <= limit]


def spread_order(ranked: list[Row]) -> list[Row]:
    """The order in which to compile candidates that are to be timed: the near-ties' distinct
    meshes, each represented by its best-ranked row, as a spread (the fastest first; then,
    each time, the mesh whose `mesh_distance` to the nearest of those already taken is the
    largest, the better-ranked on a tie), followed by every other row of `ranked` in its order.
    With one mesh among the near-ties (a clear winner), this is `ranked` itself. Deterministic:
    every process of a run orders alike."""
    first: dict[tuple, Row] = {}  # a mesh -> its best-ranked near-tie, in ranked order
    for row in near_ties(ranked):
        first.setdefault(_mesh(row.candidate), row)
    left = list(first.values())
    order = left[:1]
    del left[:1]
    while left:
        far = max(range(len(left)),  # max keeps the first of equals: the better-ranked
                  key=lambda i: min(mesh_distance(left[i].candidate, o.candidate)
                                    for o in order))
        order.append(left.pop(far))
    taken = {r.candidate for r in order}
    return order + [r for r in ranked if r.candidate not in taken]


def _compile(row: Row, config: ml_collections.ConfigDict, devices, chip: Chip, log) -> Row:
    """`row` with the compiler's memory and collectives (or its error)."""
    c = row.candidate
    log(f"compiling {c.summary()} ...")
    start = time.perf_counter()
    c_config = c.apply(config)
    out = dataclasses.replace(row)
    try:
        compiled, out.compiled = compile_train_step(c_config, devices)
    except (jax.errors.JaxRuntimeError, MeshLayoutError) as e:
        if not (isinstance(e, MeshLayoutError) or refused_by_xla(e)):
            raise
        out.error = " ".join(str(e).split())[:200] or type(e).__name__
        out.compile_seconds = time.perf_counter() - start
        log(f"  refused: {out.error}")
        return out
    out.compile_seconds = time.perf_counter() - start
    out.executable = compiled
    hlo = compiled.as_text()
    out.collectives = parse_collectives(hlo, c.mesh_shape, c.sizes()[0])
    out.time = rank.step_time(c_config, model_spec(c_config), c, out.collectives, chip,
                              len(devices), bytes_accessed(hlo))
    log(f"  {out.compiled.total / GIB:.2f} GiB per device (estimate "
        f"{row.estimate.total / GIB:.2f}), {out.time.total:.3g} s per step, compiled in "
        f"{out.compile_seconds:.0f} s")
    return out
