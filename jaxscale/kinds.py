"""The kinds of number a config key or a command-line flag may hold: whole or real, an interval,
and values with a meaning of their own (mesh's -1: the devices left over). The config's table of
every key's kind (`jaxscale.config.NUMBERS`), the flags of every entry point and the data sources'
own numbers are all checked with these, so a bad number reads the same wherever it is given."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

_INTERVAL = re.compile(r"([\[(])(-?\d+(?:\.\d+)?), (\d+(?:\.\d+)?|inf)([\])])")


@dataclasses.dataclass(frozen=True)
class Number:
    """The kind of a numeric key: whole numbers or any finite number, inside an interval, and the
    values with a meaning of their own (`meanings`: value -> what it means), allowed even outside
    the interval (mesh's -1: the devices left over). Written `whole("[1, inf)")`,
    `real("[0, 1)")`, `whole("[0, inf)", {0: "off"})`."""
    whole: bool
    low: float
    high: float
    low_open: bool
    high_open: bool
    meanings: dict

    def inside(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def allowed(self) -> str:
        """What the key may hold, as an error message says it: '>= 1, or -1 (the devices left
        over)', 'in [0, 1)', '>= 0 (0: off)'."""
        if self.high == math.inf:
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            text = (f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                    f"{_number(self.high)}{')' if self.high_open else ']'}")
        inside = [f"{_number(v)}: {m}" for v, m in self.meanings.items() if self.inside(v)]
        outside = [f"{_number(v)} ({m})" for v, m in self.meanings.items() if not self.inside(v)]
        return (text + (f" ({'; '.join(inside)})" if inside else "")
                + "".join(f", or {o}" for o in outside))

    def problem(self, value) -> str | None:
        """'must be ...' when `value` is not of this kind (another type, NaN, infinite, out of
        range), else None."""
        kind = numbers.Integral if self.whole else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"must be {'a whole number' if self.whole else 'a number'} {self.allowed()}"
        if not math.isfinite(value):
            return f"must be a finite number {self.allowed()}"
        if value in self.meanings or self.inside(value):
            return None
        return f"must be {self.allowed()}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _kind(whole: bool, interval: str, meanings: dict | None) -> Number:
    match = _INTERVAL.fullmatch(interval)
    if match is None:
        raise ValueError(f"interval {interval!r} is not written like '[0, 1)' or '(0, inf)'")
    opening, low, high, closing = match.groups()
    parse = int if whole else float
    return Number(whole, parse(low), math.inf if high == "inf" else parse(high),
                  opening == "(", closing == ")", meanings or {})


def whole(interval: str, meanings: dict | None = None) -> Number:
    return _kind(True, interval, meanings)


def real(interval: str, meanings: dict | None = None) -> Number:
    return _kind(False, interval, meanings)
