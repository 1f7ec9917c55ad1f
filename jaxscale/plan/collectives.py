"""The collectives of a compiled program, read from its HLO text: kind, bytes per device, how many
times they run per step, and which mesh axes (so which links) they cross.

HLO names no mesh axis: a collective lists the devices that take part (its replica groups, in
partition ids, i.e. positions in the mesh's flattened device array). Unravelling those positions
over the mesh's shape tells which axes vary inside a group. Three spellings occur:
`{{0,1},{2,3}}`, the iota form `[2,2]<=[2,2]T(1,0)`, and the mesh form
`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` (the compiler's own axes, optionally with
`device_ids=(<iota>)`). A collective inside a while loop (the scan over layers, over microbatches)
runs once per iteration: counts are multiplied by the loops' trip counts (the compiler's
`known_trip_count`, else the bound in the scan's `i < N` condition). An asynchronous start (a
GPU's `all-to-all-start`, `reduce-scatter-start`) returns its operands beside its outputs: only
the outputs count. On TPU a reduce-scatter is a fusion that calls an `all-reduce-scatter`
computation; its all-reduce is counted as the reduce-scatter it is.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Mapping, Sequence

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all|"
    r"collective-permute)(-start)?\(")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_WHILE_CONDITION = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONSTANT = re.compile(r"= s32\[\][^ ]* constant\((\d+)\)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    bytes: int  # per device, per execution: the full (unsharded) buffer the collective moves
    count: int  # executions per step
    axes: tuple[str, ...]  # mesh axes its groups span; ("?",) when the groups could not be read
    group_size: int
    crosses_dcn: bool  # a group spans more than one slice / node

    @property
    def link_bytes(self) -> float:
        """Bytes each device sends per execution with ring algorithms: an all-reduce is a
        reduce-scatter then an all-gather, each moving (n - 1) / n of the buffer."""
        n = self.group_size
        if self.kind == "collective-permute":
            return self.bytes
        share = (n - 1) / n if n > 1 else 0.0
        return self.bytes * share * (2 if self.kind == "all-reduce" else 1)


def shapes_bytes(text: str) -> list[int]:
    """The bytes of each array shape written in `text` (`bf16[4,2048]{1,0}`: 16384)."""
    return [_DTYPE_BYTES.get(dtype, 0) * math.prod(int(d) for d in dims.split(",") if d)
            for dtype, dims in _SHAPE.findall(text)]


def _tuple_items(text: str) -> list[str]:
    """The top-level items of a tuple type (`((bf16[2]{0}), bf16[2]{0})`: `(bf16[2]{0})` and
    `bf16[2]{0}`); a type that is no tuple is its own one item."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    items, depth, begin = [], 0, 1
    for i, char in enumerate(text[1:-1], start=1):
        depth += char in "([{"
        depth -= char in ")]}"
        if char == "," and depth == 0:
            items.append(text[begin:i])
            begin = i + 1
    return items + [text[begin:-1]]


def _written_bytes(op: str, started: bool, type_text: str) -> list[int]:
    """The bytes of each buffer collective `op` writes, from its result type `type_text`. An
    asynchronous start (`started`, `all-gather-start`) of any op but all-reduce returns
    (operands, outputs[, contexts]): its outputs are the second item."""
    items = _tuple_items(type_text)
    if started and op != "all-reduce" and len(items) > 1:
        type_text = items[1]
    return shapes_bytes(type_text)


def _iota(spec: str) -> np.ndarray:
    """`[2,2]T(1,0)`-style device order (dims, then an optional transpose), flattened."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
    dims = [int(d) for d in m.group(1).split(",")]
    order = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        order = order.transpose([int(p) for p in m.group(2).split(",")])
    return order.reshape(-1)


def replica_groups(line: str) -> list[list[int]] | None:
    """The groups of partition ids of one collective instruction, or None if unreadable."""
    if m := re.search(r"source_target_pairs=\{(\{[\d,{}]*\})\}", line):
        return [[int(x) for x in pair.split(",")] for pair in re.findall(r"\{([\d,]+)\}",
                                                                          m.group(1))]
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                        m.group(1))]
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", line):
        return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? "
                      r"\{([^}]*)\}", line):
        names = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        if not names:
            return None
        sizes = [int(n) for _, n in names]
        order = (_iota(m.group(2)) if m.group(2) else np.arange(math.prod(sizes))).reshape(sizes)
        spanned = [i for i, (name, _) in enumerate(names)
                   if f"'{name}'" in m.group(3)]
        kept = [i for i in range(len(sizes)) if i not in spanned]
        grouped = order.transpose(kept + spanned)
        return grouped.reshape(-1, math.prod(sizes[i] for i in spanned)).tolist()
    return None


def _axes_of(groups: list[list[int]], mesh_shape: Mapping[str, int],
             ici_shape: Mapping[str, int]) -> tuple[tuple[str, ...], bool]:
    """(mesh axes along which members of a group differ, whether a group spans granules)."""
    names = list(mesh_shape)
    sizes = [mesh_shape[a] for a in names]
    varying, crosses = set(), False
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # [members, axes]
        for i, name in enumerate(names):
            if len(set(coords[:, i])) > 1:
                varying.add(name)
                # The DCN factor is the outer part of an axis (create_hybrid_device_mesh).
                crosses |= len(set(coords[:, i] // ici_shape[name])) > 1
    return tuple(a for a in names if a in varying), crosses


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the ENTRY computation's name."""
    bodies, entry, current = {}, None, None
    for line in hlo.splitlines():
        if current is None:
            if m := _HEADER.match(line):
                current = m.group(1)
                bodies[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            bodies[current].append(line)
    return bodies, entry


def executions(hlo: str) -> tuple[dict[str, list[str]], collections.Counter]:
    """The computations of `hlo` (name -> instruction lines) and how many times each runs per
    step: the ENTRY once, a while loop's body and condition once per trip (the compiler's
    `known_trip_count`, else the bound of a scan's `i < N` condition: scans count from 0 by 1;
    else 1), anything else as often as its caller. Empty when `hlo` has no ENTRY."""
    bodies, entry = _computations(hlo)
    runs: collections.Counter = collections.Counter()

    def trip_count(line: str) -> int:
        if t := _TRIP_COUNT.search(line):
            return int(t.group(1))
        condition = bodies.get(c.group(1), ()) if (c := _WHILE_CONDITION.search(line)) else ()
        bounds = [int(b.group(1)) for l in condition if (b := _CONSTANT.search(l))]
        compares_lt = any("compare(" in l and "direction=LT" in l for l in condition)
        return bounds[0] if len(bounds) == 1 and compares_lt else 1

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for line in bodies.get(name, ()):
            trips = trip_count(line) if " while(" in line else 1
            body = w.group(1) if (w := _WHILE_BODY.search(line)) else None
            callees = _CALLEE.findall(line) + [c.strip().lstrip("%") for b in
                                               _BRANCHES.findall(line) for c in b.split(",")]
            for callee in callees:
                if callee in bodies:
                    visit(callee, times * (trips if callee == body else 1))

    if entry is not None:
        visit(entry, 1)
    return bodies, runs


def parse_collectives(hlo: str, mesh_shape: Mapping[str, int],
                      ici_shape: Mapping[str, int] | None = None) -> list[Collective]:
    """The collectives of `hlo` (a `compiled.as_text()`) on a mesh of `mesh_shape` (axis -> size
    over the whole mesh, in the mesh's axis order); `ici_shape` gives each axis's size inside a
    granule (default: all of it). Identical collectives are merged, their counts added."""
    ici_shape = ici_shape or mesh_shape
    bodies, runs = executions(hlo)
    merged: collections.Counter = collections.Counter()
    for name, times in runs.items():
        for line in bodies[name]:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            kind = m.group(2)
            size = sum(_written_bytes(kind, bool(m.group(3)), m.group(1)))
            if kind == "all-reduce" and name.startswith("all-reduce-scatter"):
                kind = "reduce-scatter"
            groups = replica_groups(line)
            if groups == [[]]:  # no groups written: every device takes part
                groups = [list(range(math.prod(mesh_shape.values())))]
            if groups is None:
                axes, crosses, group_size = ("?",), False, 0
            else:
                groups = [g for g in groups if len(set(g)) > 1] or groups
                axes, crosses = _axes_of(groups, mesh_shape, ici_shape)
                group_size = 2 if kind == "collective-permute" else len(groups[0])
            if kind == "reduce-scatter" and not name.startswith("all-reduce-scatter"):
                size *= max(group_size, 1)  # a plain reduce-scatter's result is one shard
            merged[(kind, size, axes, group_size, crosses)] += times
    return [Collective(kind, size, count, axes, group_size, crosses)
            for (kind, size, axes, group_size, crosses), count in merged.items()]


def bytes_by_kind(collectives: Sequence[Collective]) -> dict[str, int]:
    """Bytes per device per step moved by each kind (buffer sizes times executions)."""
    totals = {k: 0 for k in KINDS}
    for c in collectives:
        totals[c.kind] += c.bytes * c.count
    return totals
