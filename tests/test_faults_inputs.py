"""Every number checked by its kind, not by example (issue 23, item 9).

Every numeric key of `default_config()` declares its kind in `jaxscale.config.SCHEMA` (whole or
real, an interval, the values with a meaning of their own; `NUMBERS` gathers them). From each kind
the values that break it are generated -- another type, NaN, the infinities, and the numbers just
past each end of the interval (negative and zero among them) -- and `validate` must refuse each with
one line that starts with `KEY=VALUE must be`. A few go through the real command line, which must
print that line alone, exit 2 and leave the fresh workdir unmade. The path flags of each entry point
are checked by kind in tests/test_bad_inputs.py, with every other bad input.
"""

import math
import os
import subprocess
import sys

import ml_collections
import pytest

from jaxscale.checks import validate
from jaxscale.config import NUMBERS, check_schema, default_config
from jaxscale.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def numeric_keys(group: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in group.items():
        if isinstance(value, ml_collections.ConfigDict):
            keys += numeric_keys(value, f"{prefix}{name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            keys.append(prefix + name)
    return keys


def test_every_number_of_the_schema_has_a_kind():
    """A number added to the schema without its kind fails here."""
    keys = numeric_keys(default_config())
    assert len(keys) >= 70
    assert sorted(keys) == sorted(NUMBERS)


def with_value(key: str, value) -> ml_collections.ConfigDict:
    """The defaults with `key` set to `value`, whatever its type: ml_collections refuses another
    type on assignment, but not in a group replaced whole (as a config file may replace one)."""
    config = default_config()
    *groups, name = key.split(".")
    parent = config
    for group in groups[:-1]:
        parent = parent[group]
    parent[groups[-1]] = dict(parent[groups[-1]], **{name: value})
    return config


def outside(kind, value) -> bool:
    """Whether a number is outside `kind`'s interval and has no meaning of its own: written out
    here rather than taken from `Number`, so that a wrong `Number` cannot pass its own test."""
    below = value < kind.low or (value == kind.low and kind.low_open)
    above = value > kind.high or (value == kind.high and kind.high_open)
    return (below or above) and value not in kind.meanings


def bad_values(kind) -> list:
    """What breaks `kind`: another type, NaN, the infinities, and each number next to an end of
    its interval, -2, -1 and 0 that it does not allow."""
    wrong = ["ten", None, True, math.nan, math.inf, -math.inf] + ([1.5] if kind.whole else [])
    step = 1 if kind.whole else 0.5
    near = [-2, -1, 0, kind.low - step, kind.low, kind.high, kind.high + step]
    numbers = [v for v in dict.fromkeys(near) if math.isfinite(v) and outside(kind, v)]
    return wrong + numbers


CASES = [(key, value) for key in sorted(NUMBERS) for value in bad_values(NUMBERS[key])]


def test_every_kind_has_numbers_out_of_range():
    """Each key is tested past an end of its range, not only with the wrong types."""
    assert all(len(bad_values(kind)) > 6 + kind.whole for kind in NUMBERS.values())
    assert len(CASES) >= 600


@pytest.mark.parametrize("key", sorted(NUMBERS))
def test_a_number_not_of_its_kind_is_one_error_line_naming_the_key_and_value(key):
    for value in bad_values(NUMBERS[key]):
        with pytest.raises(ConfigError) as raised:
            validate(with_value(key, value), 8)
        message = str(raised.value)
        assert message.startswith(f"{key}={value!r} must be ") and "\n" not in message, message


def good_values(kind) -> list:
    """The ends of the interval that it includes, the first numbers inside the open ends, and the
    values with a meaning of their own."""
    step = 1 if kind.whole else 0.5
    ends = [kind.low + step if kind.low_open else kind.low]
    if math.isfinite(kind.high):
        ends.append(kind.high - step if kind.high_open else kind.high)
    return ends + list(kind.meanings)


@pytest.mark.parametrize("key", sorted(NUMBERS))
def test_the_ends_of_a_range_and_the_special_values_are_allowed(key):
    for value in good_values(NUMBERS[key]):
        check_schema(with_value(key, value))


# What config.py's comments and the README's Config keys promise, written out by hand: a change to
# NUMBERS that breaks a promise (mesh.data=-1 is "the rest", eval_every=0 turns eval off, ...)
# fails here.
PROMISES = [
    *[(f"mesh.{axis}", -1, True) for axis in ("data", "fsdp", "tensor", "pipeline", "expert",
                                              "context")],
    ("mesh.dcn.data", -1, False), ("mesh.data", 0, False),
    ("train.eval_every", 0, True), ("train.eval_batches", 0, False),
    ("train.straggler_ratio", 1.0, False), ("train.seed", 0, True), ("train.seed", 2 ** 63, False),
    ("checkpoint.every_steps", 0, True), ("checkpoint.every_minutes", 0.0, True),
    ("checkpoint.keep_every_steps", 0, True), ("checkpoint.keep", 0, False),
    ("profile.steps", 0, True), ("pipeline.microbatches", 0, True),
    ("data.workers", -1, True), ("data.workers", 0, True), ("data.workers", -2, False),
    ("data.max_segments", 0, True), ("data.max_segments", 1, False), ("data.prefetch", 0, True),
    ("model.loss_chunk_len", 0, True), ("model.moe.every", 0, True),
    ("model.moe.aux_loss_weight", 0.0, True), ("model.rope_theta", 1.0, False),
    ("model.rope_scaling.factor", 1.0, True), ("model.norm_eps", 0.0, False),
    ("optim.lr", 0.0, False), ("optim.warmup_steps", 0, True),
    ("optim.min_lr_ratio", 0.0, True), ("optim.min_lr_ratio", 1.0, True),
    ("optim.min_lr_ratio", 1.01, False), ("optim.b1", 0.0, True), ("optim.b1", 1.0, False),
    ("optim.b2", 0.999, True), ("optim.b2", 1.0, False), ("optim.eps", 0.0, False),
    ("optim.grad_clip", 0.0, True), ("optim.weight_decay", 0.0, True),
    ("performance.device_memory_gib", 0.0, True), ("mesh.auto_memory_gib", 0.0, True),
    ("mesh.auto_trials", 0, False), ("precision.loss_scale_growth_interval", 0, False),
    ("distributed.init_timeout_s", 0.0, False),
]


@pytest.mark.parametrize("key, value, allowed", PROMISES)
def test_documented_values_keep_their_meaning(key, value, allowed):
    config = with_value(key, value)
    if allowed:
        check_schema(config)
    else:
        with pytest.raises(ConfigError, match=f"^{key}="):
            check_schema(config)


@pytest.mark.parametrize("key, value, message", [
    ("train.steps", "ten", "train.steps='ten' must be a whole number >= 1"),
    ("optim.lr", math.nan, "optim.lr=nan must be a finite number > 0"),
    ("optim.b1", 1.0, "optim.b1=1.0 must be in [0, 1)"),
    ("mesh.fsdp", -2, "mesh.fsdp=-2 must be >= 1, or -1 (the devices left over)"),
    ("train.eval_every", -1, "train.eval_every=-1 must be >= 0 (0: no periodic eval)"),
    ("data.max_segments", 1, "data.max_segments=1 must be >= 2, or 0 (no bound)"),
])
def test_the_message_says_what_the_key_takes(key, value, message):
    with pytest.raises(ConfigError) as raised:
        validate(with_value(key, value), 8)
    assert str(raised.value) == message


# Through the real command line: one of each kind of mistake (NaN, infinity, past the end of a
# fraction, a special value's neighbour, zero, negative, another type).
@pytest.mark.parametrize("override, named", [
    ("optim.lr=nan", "optim.lr=nan"),
    ("checkpoint.every_minutes=inf", "checkpoint.every_minutes=inf"),
    ("optim.b2=1", "optim.b2=1.0"),
    ("mesh.context=-2", "mesh.context=-2"),
    ("train.eval_batches=0", "train.eval_batches=0"),
    ("train.seed=-1", "train.seed=-1"),
    ("train.steps=1.5", "train.steps=1.5"),
])
def test_the_train_command_refuses_a_number_and_writes_nothing(override, named, tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", f"--workdir={workdir}", f"--config.{override}"],
        cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert not workdir.exists()
