"""The memory-traffic term of the planner's step time: the bytes a compiled program moves, counted
from its HLO with loops counted once per trip (`traffic.bytes_accessed`), over the chip's HBM
bandwidth, in a roofline with the compute (`rank.step_time`)."""

import jax
import jax.numpy as jnp
import pytest

from jaxscale.cli import load_config_file
from jaxscale.models.spec import model_spec
from jaxscale.plan import rank
from jaxscale.plan.search import Candidate, layout
from jaxscale.plan.traffic import bytes_accessed
from jaxscale.runtime.chips import CHIPS
from tests.helpers import small_config


def _layers(n: int, unroll, backward: bool = True):
    """Forward (and backward) of `n` two-matmul layers run by a `lax.scan` (a loop, or
    unrolled)."""
    def loss(w, x):
        def layer(x, w):
            return jnp.tanh(x @ w[0]) @ w[1], None
        return jax.lax.scan(layer, x, w, unroll=unroll)[0].sum()

    w = jnp.ones((n, 2, 256, 256))
    x = jnp.ones((128, 256))
    return jax.jit(jax.grad(loss) if backward else loss).lower(w, x).compile()


def _xla_bytes(compiled) -> float:
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]


def test_without_loops_the_count_is_xlas_own():
    """On a program without loops, the count agrees with XLA's cost analysis (an independent
    implementation of the same rules)."""
    compiled = _layers(3, unroll=True)
    assert bytes_accessed(compiled.as_text()) == pytest.approx(_xla_bytes(compiled), rel=0.01)


@pytest.mark.parametrize("backward", [False, True])
def test_a_loop_counts_once_per_trip_where_xla_counts_it_once(backward):
    """The count grows by the same bytes with every 4 scanned layers added (the body once per
    trip), and by more than XLA's figure, which counts the body once: for the forward pass alone
    XLA's does not grow at all."""
    programs = {n: _layers(n, unroll=1, backward=backward) for n in (4, 8, 12)}
    counted = {n: bytes_accessed(p.as_text()) for n, p in programs.items()}
    xla = {n: _xla_bytes(p) for n, p in programs.items()}
    assert counted[8] - counted[4] == counted[12] - counted[8] > xla[8] - xla[4]
    if not backward:
        assert xla[4] == xla[8]


# A layer loop as the compiler prints one, five trips: a fusion takes layer i's weights out of the
# stack (in a nested fusion, as the TPU compiler writes it; parameters printed out of order), a
# dot applies them, a fusion saves the output into a stack of activations in place.
LOOP = """HloModule layers

%slice (p0: f32[5,64,64], p1: s32[]) -> f32[64,64] {
  %p1 = s32[] parameter(1)
  %p0 = f32[5,64,64]{2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %ds = f32[1,64,64]{2,1,0} dynamic-slice(%p0, %p1, %zero, %zero), dynamic_slice_sizes={1,64,64}
  ROOT %b = f32[64,64]{1,0} bitcast(%ds)
}

%take (p0: f32[5,64,64], p1: s32[]) -> f32[64,64] {
  %p0 = f32[5,64,64]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %s = f32[64,64]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%slice
}

%save (p0: f32[5,8,64], p1: f32[8,64], p2: s32[]) -> f32[5,8,64] {
  %p1 = f32[8,64]{1,0} parameter(1)
  %b = f32[1,8,64]{2,1,0} bitcast(%p1)
  %p0 = f32[5,8,64]{2,1,0} parameter(0)
  %p2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[5,8,64]{2,1,0} dynamic-update-slice(%p0, %b, %p2, %zero, %zero)
}

%body (t: (s32[], f32[8,64], f32[5,64,64], f32[5,8,64])) -> (s32[], f32[8,64], f32[5,64,64], f32[5,8,64]) {
  %t = (s32[], f32[8,64], f32[5,64,64], f32[5,8,64]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[8,64]{1,0} get-tuple-element(%t), index=1
  %w = f32[5,64,64]{2,1,0} get-tuple-element(%t), index=2
  %acts = f32[5,8,64]{2,1,0} get-tuple-element(%t), index=3
  %wi = f32[64,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%take
  %y = f32[8,64]{1,0} dot(%x, %wi), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %saved = f32[5,8,64]{2,1,0} fusion(%acts, %y, %i), kind=kLoop, calls=%save
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[8,64], f32[5,64,64], f32[5,8,64]) tuple(%next, %y, %w, %saved)
}

%cond (t: (s32[], f32[8,64], f32[5,64,64], f32[5,8,64])) -> pred[] {
  %t = (s32[], f32[8,64], f32[5,64,64], f32[5,8,64]) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: f32[8,64], w: f32[5,64,64], acts: f32[5,8,64]) -> f32[5,8,64] {
  %x = f32[8,64]{1,0} parameter(0)
  %w = f32[5,64,64]{2,1,0} parameter(1)
  %acts = f32[5,8,64]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,64], f32[5,64,64], f32[5,8,64]) tuple(%zero, %x, %w, %acts)
  %loop = (s32[], f32[8,64], f32[5,64,64], f32[5,8,64]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[5,8,64]{2,1,0} get-tuple-element(%loop), index=3
}
"""


def test_slices_and_in_place_updates_move_only_their_part_once_per_trip():
    """Worked by hand, per trip: the weights' slice read and written (2 x 64 x 64 x 4 bytes, and
    the 4-byte index), the dot's operands read and result written (8 x 64 + 64 x 64 + 8 x 64 floats), the saved
    activation read and written into the stack without reading the stack (2 x 8 x 64 floats, and
    the 4-byte index), the counter's add (3 x 4 bytes); the loop's condition once (4 + 4 + 1)."""
    per_trip = (2 * 64 * 64 * 4 + 4) + (8 * 64 + 64 * 64 + 8 * 64) * 4 + (2 * 8 * 64 * 4 + 4) + 12
    assert bytes_accessed(LOOP) == 5 * per_trip + 9


def _candidate(remat: str) -> Candidate:
    return Candidate(*layout({"fsdp": 1}), remat, 1, "params")


def test_the_memory_term_is_the_programs_bytes_over_the_chips_bandwidth_in_a_roofline():
    """memory = bytes / HBM bandwidth; the step is the longest of compute, memory traffic and
    overlapped communication, plus the exposed communication; no bytes, no term."""
    config, chip = small_config(), CHIPS["H100 SXM"]
    spec, c = model_spec(config), _candidate("none")
    without = rank.step_time(config, spec, c, [], chip, 1)
    assert without.memory is None and without.total == without.compute
    heavy = 10 * without.compute * chip.hbm_bandwidth  # ten times the compute's seconds
    t = rank.step_time(config, spec, c, [], chip, 1, bytes_accessed=int(heavy))
    assert t.memory == pytest.approx(10 * without.compute)
    assert t.total == pytest.approx(t.memory + t.exposed)
    light = rank.step_time(config, spec, c, [], chip, 1, bytes_accessed=1)
    assert light.total == light.compute


def test_traffic_reverses_a_ranking_by_flops_when_it_dominates():
    """Remat none does fewer FLOPs than save_dots, so ranks first on compute alone; when the
    traffic dominates and none moves more bytes (it keeps every activation), save_dots ranks
    first, by the ratio of the bytes."""
    config, chip = load_config_file("configs/llama_1b.py"), CHIPS["H100 SXM"]
    config.train.update(batch_size=4, seq_len=2048)
    spec = model_spec(config)

    def total(remat, traffic=None):
        return rank.step_time(config, spec, _candidate(remat), [], chip, 1, traffic).total

    assert total("none") < total("save_dots")
    heavy = 10 * total("save_dots") * chip.hbm_bandwidth
    assert total("save_dots", heavy) < total("none", 1.2 * heavy)
    assert total("none", 1.2 * heavy) / total("save_dots", heavy) == pytest.approx(1.2)
