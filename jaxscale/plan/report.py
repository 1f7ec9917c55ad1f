"""A plan as a table for people and as JSON for programs (the same facts in both)."""

from __future__ import annotations

import dataclasses

from jaxscale.plan.collectives import KINDS, bytes_by_kind
from jaxscale.plan.planner import FIT_FRACTION, Plan, Row
from jaxscale.runtime import cuda_plugin
from jaxscale.runtime.chips import GIB

_SHORT = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR", "all-to-all": "A2A",
          "collective-permute": "CP"}


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _size(n: float) -> str:
    """A capacity or budget in GiB to three significant digits: --hbm_gib=0.04 is no 0.0."""
    return f"{n / GIB:.3g}"


def _mfu(plan: Plan, row: Row) -> float | None:
    """None on CPUs: their rates are nominal, good for ranking, not for a utilisation."""
    if plan.target.chip is None:
        return None
    return row.time.mfu(plan.target.num_devices, plan.chip.peak_bf16_flops)


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def header(plan: Plan) -> str:
    t, chip = plan.target, plan.chip
    memory = (f"{_size(plan.capacity)} GiB per device, fits below {_size(plan.budget)}"
              if plan.capacity else "memory per device unknown (pass --hbm_gib)")
    how = ("compiled for the target" if t.compiles
           else f"estimates only: no GPU compiler here ({cuda_plugin.INSTALL_HINT}), so no "
                "compiled memory and no memory traffic")
    return (f"plan for {t.name}: {t.num_devices} x {chip.name}"
            f"{f' in {t.granules} nodes' if t.granules > 1 else ''}, {memory}; "
            f"{plan.searched} candidates, {how}, {plan.seconds:.0f} s")


def table(plan: Plan) -> str:
    """One line per shown candidate: its layout, step settings (layer loop, logits' slices),
    memory (compiler's and estimated), the bytes each kind of collective moves per device per step
    (GiB; from the HLO when compiled, else counted from the shapes), the seconds of compute at
    peak and of memory traffic (compiled only: "-" where not), the estimated step time and MFU,
    and the verdict."""
    columns = ["mesh", "pipeline", "bubble", "remat", "accum", "opt", "step", "GiB/dev",
               "est GiB", *(_SHORT[k] for k in KINDS), "flops s", "HBM s", "step s", "MFU@peak",
               "verdict"]
    lines = [columns]
    for row in plan.rows:
        c = row.candidate
        moved = bytes_by_kind(row.collectives)
        verdict = plan.verdict(row) + (f" [{row.role}]" if row.role else "")
        lines.append([
            c.mesh_label, c.pipeline_label, f"{row.time.bubble:.1%}" if c.pipeline else "-",
            c.remat, str(c.microbatches),
            "zero1" if c.optimizer_state == "data" else "params",
            c.step.cell() if c.step else "-",
            _gib(row.compiled.total) if row.compiled else "-", _gib(row.estimate.total),
            *(f"{moved[k] / GIB:.2f}" if moved[k] else "-" for k in KINDS),
            f"{row.time.compute:.3g}",
            "-" if row.time.memory is None else f"{row.time.memory:.3g}",
            f"{row.time.total:.3g}", _percent(_mfu(plan, row)), verdict])
    widths = [max(len(line[i]) for line in lines) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip()
                     for line in lines)


def chosen(plan: Plan) -> str:
    """`chosen: ...` and the flags to paste, or why nothing was chosen."""
    row = plan.chosen
    if row is None:
        return f"chosen: none; {no_fit(plan)}"
    c = row.candidate
    where = "compiled" if row.compiled else "estimated"
    return (f"chosen: {c.summary()}: {_gib(row.bytes)} GiB per device ({where}), "
            f"est. {row.time.total:.3g} s per step, MFU at peak {_percent(_mfu(plan, row))}\n"
            + " ".join(c.overrides()))


def no_fit(plan: Plan) -> str:
    """Why nothing was chosen, with the smallest candidate's shortfall and the remedies."""
    small = plan.smallest
    c = small.candidate
    return (f"no layout of {plan.target.num_devices} devices fits the model in "
            f"{_size(plan.budget)} GiB per device ({FIT_FRACTION:.0%} of "
            f"{_size(plan.capacity)}): the smallest, {c.summary()}, needs "
            f"{_size(small.bytes)} GiB (estimated), "
            f"{_size(small.bytes - plan.budget)} GiB too many; use more devices, a smaller "
            "train.batch_size or train.seq_len, or a smaller model")


def as_json(plan: Plan) -> dict:
    def row_dict(row: Row) -> dict:
        c = row.candidate
        return dict(
            mesh=c.mesh_shape, dcn=c.sizes()[1], remat=c.remat,
            microbatches=c.microbatches, optimizer_state=c.optimizer_state,
            step=dataclasses.asdict(c.step) if c.step else None,
            pipeline=dict(schedule=c.schedule, microbatches=c.pipeline_microbatches,
                          bubble=row.time.bubble) if c.pipeline else None,
            compiled_bytes=row.compiled.total if row.compiled else None,
            compiled=vars(row.compiled) if row.compiled else None,
            estimated_bytes=row.estimate.total, estimate=vars(row.estimate),
            collective_bytes=bytes_by_kind(row.collectives),
            collectives_from="hlo" if row.compiled else "estimate",
            step_seconds=row.time.total, compute_seconds=row.time.compute,
            memory_seconds=row.time.memory,
            overlapped_comm_seconds=row.time.overlapped, exposed_comm_seconds=row.time.exposed,
            mfu=_mfu(plan, row),
            compile_seconds=row.compile_seconds, error=row.error, role=row.role or None,
            verdict=plan.verdict(row), overrides=c.overrides())

    return dict(
        target=plan.target.name, platform=plan.target.platform, devices=plan.target.num_devices,
        chip=plan.chip.name, capacity_bytes=plan.capacity,
        budget_bytes=plan.budget if plan.capacity else None, compiled=plan.target.compiles,
        candidates=plan.searched, seconds=plan.seconds,
        rows=[row_dict(r) for r in plan.rows],
        chosen=row_dict(plan.chosen) if plan.chosen else None)
