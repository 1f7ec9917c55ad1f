"""The bytes a compiled program reads and writes in device memory per step, counted from its HLO
text: the memory-traffic term of the step time (rank.py).

`compiled.cost_analysis()["bytes accessed"]` counts a while loop's body once, whatever its trip
count: for a model whose layers run in a `lax.scan` that is one layer of all of them. So the
count is made here the way XLA's cost analysis makes it, per instruction, and multiplied by how
often the instruction's computation runs (`collectives.executions`: loops' trip counts). An
instruction reads its operands and writes its result; a fusion reads only the slice of an operand
that it only slices (a layer's weights out of the stacked layers), and a fusion that updates a
buffer in place (a dynamic-update-slice, a layer's saved activations into their stack) writes
only the update and does not read the buffer, through bitcasts and nested fusions. Instructions
that move no data (parameters, constants, tuples, bitcasts; loops and calls, whose computations
are counted themselves) count nothing; an asynchronous operation counts at its start. On a
program without loops the count is XLA's own (tests/test_plan_traffic.py).
"""
from __future__ import annotations

import re
from typing import NamedTuple

from jaxscale.plan.collectives import executions, shapes_bytes

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
         "conditional", "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency"}
_SLICES = {"dynamic-slice", "slice"}


class _Op(NamedTuple):
    opcode: str
    size: int  # bytes of the result
    args: list[str]  # operand names
    callee: str | None  # a fusion's computation
    parameter: int | None  # a parameter's number (they are not printed in order)


def _parse(lines: list[str]) -> dict[str, _Op]:
    """The instructions of one computation by name, in order."""
    found = {}
    for line in lines:
        if m := _INSTRUCTION.match(line):
            name, shape, opcode, rest = m.groups()
            callee = c.group(1) if (c := _CALLS.search(rest)) else None
            number = int(rest.split(")")[0]) if opcode == "parameter" else None
            found[name] = _Op(opcode, sum(shapes_bytes(shape)),
                              _OPERAND.findall(_operands(rest)), callee, number)
    return found


def _operands(rest: str) -> str:
    """The operand list of an instruction: `rest` (what follows `opcode(`) up to its `)`."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i]
    return rest


def _fusion_bytes(parsed: dict[str, dict[str, _Op]], fused: str, operands: list[int]) -> int:
    """Bytes the fusion calling computation `fused` moves: each operand read (`_read`), each
    result written (`_written`)."""
    ops = parsed[fused]
    read = sum(min(_read(parsed, fused, name, operands[op.parameter]), operands[op.parameter])
               for name, op in ops.items() if op.opcode == "parameter")
    return read + _written(parsed, fused)


def _users(ops: dict[str, _Op]) -> dict[str, list[tuple[str, int]]]:
    """Each instruction's users in a computation, with the operand position it takes there."""
    users: dict[str, list[tuple[str, int]]] = {}
    for name, op in ops.items():
        for position, arg in enumerate(op.args):
            users.setdefault(arg, []).append((name, position))
    return users


def _read(parsed: dict[str, dict[str, _Op]], fused: str, name: str, size: int) -> int:
    """Bytes a fusion's computation `fused` reads of its value `name` (a buffer of `size` bytes):
    the slices its users take, none where it is the buffer a dynamic-update-slice updates in
    place, through bitcasts and nested fusions (the TPU compiler nests them); all of it for any
    other use."""
    ops = parsed[fused]
    read = 0
    for user, position in _users(ops).get(name, ()):
        op = ops[user]
        if op.opcode in _SLICES and position == 0:
            read += op.size
        elif op.opcode == "dynamic-update-slice" and position == 0:
            continue
        elif op.opcode == "bitcast":
            read += _read(parsed, fused, user, size)
        elif op.opcode == "fusion" and op.callee in parsed:
            inner = next(n for n, o in parsed[op.callee].items() if o.parameter == position)
            read += _read(parsed, op.callee, inner, size)
        else:
            return size
    return read


def _written(parsed: dict[str, dict[str, _Op]], fused: str) -> int:
    """Bytes the computation `fused` writes as its result: each element of a tuple root, only the
    update of an in-place dynamic-update-slice, through bitcasts and nested fusions."""
    ops = parsed[fused]
    root = next(reversed(ops))  # the ROOT is printed last
    written = 0
    for out in ops[root].args if ops[root].opcode == "tuple" else [root]:
        while ops[out].opcode == "bitcast":
            out = ops[out].args[0]
        op = ops[out]
        if op.opcode == "dynamic-update-slice":
            written += ops[op.args[1]].size
        elif op.opcode == "fusion" and op.callee in parsed:
            written += min(_written(parsed, op.callee), op.size)
        else:
            written += op.size
    return written


def bytes_accessed(hlo: str) -> int:
    """Bytes read and written in device memory per step by the program `hlo` (a
    `compiled.as_text()`), per device."""
    bodies, runs = executions(hlo)
    parsed = {name: _parse(lines) for name, lines in bodies.items()}
    # Computations that run as parts of an instruction (fusions, reducers, an async op's
    # wrapped computation) are counted in that instruction, not on their own.
    inner = {c for lines in bodies.values() for line in lines
             if not re.search(r"\s(?:while|call|conditional)\(", line)
             for c in re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", line)}
    total = 0
    for name, times in runs.items():
        if name in inner:
            continue
        instructions = parsed[name]
        for op in instructions.values():
            if op.opcode in _FREE or op.opcode.endswith("-done"):
                continue
            operands = [instructions[a].size if a in instructions else 0 for a in op.args]
            if op.opcode == "fusion" and op.callee in parsed:
                moved = _fusion_bytes(parsed, op.callee, operands)
            elif op.opcode in _SLICES:
                moved = 2 * op.size
            elif op.opcode == "dynamic-update-slice":
                moved = 2 * operands[1]
            else:
                moved = sum(operands) + op.size
            total += moved * times
    return total
