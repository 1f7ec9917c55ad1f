"""Estimated step time of a candidate: compute at the chip's peak or memory traffic at its HBM
bandwidth, whichever is longer, plus communication over the links; and the order the planner
prefers.

Compute is the model's FLOPs (`DecoderConfig.flops_per_token`, not `cost_analysis()`, which counts
a scanned layer once) plus what the remat policy recomputes, at peak bf16 FLOP/s: an upper bound
on speed that ranks candidates fairly, since every one runs the same matmuls.

Pipelines (S stages, M microbatches): the stages run in lockstep and every tick costs the same on
every stage, bubble ticks included (they compute on masked data), so the layers' compute is
divided by 1 - bubble (`Pipeline.bubble_fraction`, equal stage times assumed). 1F1B runs each
stage's forward again in its backward tick (+1 forward: a third more than forward + backward),
on top of what remat recomputes inside that backward. The output head and loss are not split
over the stages: every stage computes them for its rows (1F1B inside its loop, in every tick).

Memory traffic, for a compiled candidate, is the bytes its program reads and writes in device
memory per step (`traffic.bytes_accessed`, loops counted once per trip) at the chip's HBM
bandwidth. Compute at peak misses what remat trades: keeping every activation (remat none) does
the fewest FLOPs but writes and reads the most memory; on one H100 it ran 6% slower than
save_dots, which the FLOPs alone put 3% behind it (benchmarks/RESULTS.md). The step is a
roofline over the whole program: compute and traffic overlap and the longer counts (`max`). That
is a bound, simple and optimistic: kernels run one after another, each bound by its own longer
side, so a program can be slower than both totals; the term moves a ranking only where traffic
outweighs compute over the whole step. A candidate not compiled has no program to count: its
memory term is None and the report shows `-`; the planner chooses among compiled candidates
only, so every candidate it compares has the term (GPU targets planned from another machine have
none).

Communication comes from the compiled HLO's collectives when there is one (`collectives.py`),
else from the analytic counts below (GPU targets, and the pre-ranking before compiling). Each
collective's ring traffic goes over the fast links (ICI / NVLink) or, when its groups span slices
or nodes, the network (DCN).

Overlap assumption: collectives over `data` and `fsdp` (gathering the next layer's weights,
reducing gradients) run asynchronously beside the matmuls, as XLA schedules them, so they cost
time only beyond the compute they hide behind; collectives over `tensor` sit between a layer's
matmuls (each needs the previous one's output), those over `pipeline` between a pipeline's
ticks (the next stage needs the activations sent), an MoE layer's all-to-alls over `expert`
between its router and its experts, and a layer's key/value gathers over `context` before its
attention, so their time adds in full (`_exposed`):
    step = max(compute, memory traffic, overlapped communication) + exposed communication.
The gradients' all-reduces count as overlapped over whichever axes hold replicas (data, context,
expert).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections

from jaxscale.models.spec import ModelSpec
from jaxscale.plan.collectives import Collective
from jaxscale.plan.search import DCN_AXES, Candidate
from jaxscale.runtime.chips import Chip

# On near-ties (within this fraction of the fastest) the simpler candidate wins: fewer mesh
# axes, no pipeline, less recomputation, fewer microbatches, no ZeRO-1.
NEAR_TIE = 0.03
_REMAT_ORDER = {"none": 0, "save_dots": 1, "full": 2}
# Collectives on a step's critical path: between a layer's matmuls, between pipeline ticks.
_EXPOSED_AXES = ("tensor", "pipeline")


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float  # seconds, the pipeline's bubble included
    overlapped: float  # weight gathers, gradient reductions: hidden behind compute up to its length
    exposed: float  # tensor, pipeline, expert and context communication, on the critical path
    model_flops: float  # per step, all devices (no recomputation): MFU's numerator
    bubble: float = 0.0  # the share of the layers' compute a pipeline spends idle
    memory: float | None = None  # seconds of HBM traffic; None: not compiled, so not counted

    @property
    def total(self) -> float:
        return max(self.compute, self.memory or 0.0, self.overlapped) + self.exposed

    def mfu(self, num_devices: int, peak: float) -> float:
        return self.model_flops / (self.total * num_devices * peak)


def compute_seconds(config: ml_collections.ConfigDict, spec: ModelSpec, candidate: Candidate,
                    num_devices: int, peak: float) -> tuple[float, float]:
    """(seconds of matmuls per step at `peak`, model FLOPs per step). Full remat runs the layers'
    forward pass twice (8N instead of 6N per token); save_dots recomputes only attention's score
    and value products (no weights). With a pipeline, see the module's docstring."""
    t, m = config.train, spec.config
    tokens = t.batch_size * t.seq_len
    per_token = m.flops_per_token(spec.num_params, t.seq_len)
    head = 6.0 * m.d_model * m.padded_vocab_size  # the output head's matmuls
    layers = per_token - head
    attention_forward = 4.0 * m.n_heads * m.head_dim * m.keys_seen(t.seq_len)
    layers += {"none": 0.0, "save_dots": attention_forward, "full": layers / 3}[candidate.remat]
    pipeline = candidate.pipeline
    if pipeline is None:
        return tokens * (layers + head) / (num_devices * peak), tokens * per_token
    idle = 1 / (1 - pipeline.bubble_fraction())
    if pipeline.schedule == "1f1b":
        layers += (per_token - head) / 3
        head *= idle
    seconds = tokens * (layers * idle + head * pipeline.stages) / (num_devices * peak)
    return seconds, tokens * per_token


def analytic_collectives(config: ml_collections.ConfigDict, spec: ModelSpec,
                         candidate: Candidate, granules: int) -> list[Collective]:
    """The collectives a candidate's step makes, counted from the model's shapes (weights in the
    compute dtype, gradients in `DecoderConfig.grad_dtype` but the experts' in the compute dtype,
    as the compiled programs move them): per microbatch, FSDP gathers every
    weight twice (forward, backward) and reduce-scatters its gradient; tensor parallelism
    all-reduces a layer's [tokens, d_model] activations twice per pass (after attention and after
    the MLP) over forward, backward and any remat recomputation; the gradients are all-reduced
    once per step over the axes that hold replicas of them (`_gradient_reductions`).

    An expert axis exchanges every MoE layer's dispatch buffers [rows, experts, capacity,
    d_model] by all-to-all, there and back, in every pass. A context axis all-gathers every
    layer's keys and values in each forward pass, and reduce-scatters their gradients in the
    backward (the tokens' positions and segment ids are gathered once, for all layers).

    A pipeline does all of that per tick of its loop (forward and backward ticks for GPipe, 1F1B's
    ticks doing both), for the stage's layers and a microbatch's rows; the compiled programs also
    reduce the stage's gradients over `data` in every backward tick. Between ticks each stage's
    activations go to the next stage and the last stage's output to all of them, forward and
    backward: two collective-permutes and an all-reduce over `pipeline` per tick and direction,
    as the TPU compiler emits them."""
    t, m = config.train, config.model
    shape = candidate.mesh_shape
    fsdp, tensor = shape["fsdp"], shape["tensor"]
    dcn = dict(zip(DCN_AXES, candidate.dcn))
    compute = jnp.dtype(config.precision.compute_dtype).itemsize
    grad = jnp.dtype(spec.config.grad_dtype).itemsize  # precision.grad_reduce_dtype's effect
    accumulation = candidate.microbatches  # each accumulation step runs a pipeline's whole loop
    k, layers, layer_params = accumulation, m.n_layers, _layer_params(spec)
    stage_layer_params = layer_params
    passes = 3 if candidate.remat != "none" else 2  # forward, backward, remat's forward
    rows = t.batch_size // k // _shards(config, shape, "batch")  # a microbatch's, per device
    context = _shards(config, shape, "length")
    gradient_reductions = 1
    if p := candidate.pipeline:
        stage_layer_params //= p.stages
        layers //= p.stages
        rows //= p.num_microbatches
        if p.schedule == "1f1b":  # each tick a forward and a backward
            ticks = p.num_microbatches + 2 * p.stages - 2
            passes += 1
        else:  # a loop of forward ticks, then one of backward ticks
            ticks = p.repeats * p.num_microbatches + p.stages - 1
        k = gradient_reductions = accumulation * ticks
    # One device's model slice: the stage's layers and the embedding and head, its experts.
    experts = _expert_params(spec)
    params = spec.num_params - layer_params + stage_layer_params - experts
    weights = (params + experts / shape["expert"]) * compute / tensor
    gradients = (params * grad + experts / shape["expert"] * compute) / tensor
    activations = rows * t.seq_len // context * m.d_model * compute
    found = []
    if fsdp > 1:
        found += [Collective("all-gather", int(weights), 2 * k, ("fsdp",), fsdp, dcn["fsdp"] > 1),
                  Collective("reduce-scatter", int(gradients), k, ("fsdp",), fsdp,
                             dcn["fsdp"] > 1)]
    found += _gradient_reductions(params * grad / tensor / fsdp,
                                  experts / shape["expert"] * compute / tensor / fsdp,
                                  gradient_reductions, shape, dcn)
    if tensor > 1:
        found.append(Collective("all-reduce", activations, 2 * passes * layers * k,
                                ("tensor",), tensor, False))
    if shape["expert"] > 1:
        moe = spec.config.moe
        buffers = rows * moe.experts * moe.capacity(t.seq_len) * m.d_model * compute
        found.append(Collective("all-to-all", buffers, 2 * passes * spec.config.moe_layers * k,
                                ("expert",), shape["expert"], dcn["expert"] > 1))
    if context > 1:
        kv = rows * t.seq_len * 2 * m.n_kv_heads * m.head_dim // _shards(config, shape,
                                                                         "kv_heads")
        found += [Collective("all-gather", kv * compute, (passes - 1) * layers * k,
                             ("context",), context, dcn["context"] > 1),
                  Collective("reduce-scatter", kv * compute, layers * k, ("context",), context,
                             dcn["context"] > 1)]
    if p:
        crosses = dcn["pipeline"] > 1
        found += [Collective("collective-permute", activations, 4 * k, ("pipeline",), 2,
                             crosses),
                  Collective("all-reduce", activations, 2 * k, ("pipeline",), p.stages,
                             crosses)]
    return found


def _shards(config: ml_collections.ConfigDict, shape: dict[str, int], logical: str) -> int:
    """How many ways the rules split a logical axis on a mesh of `shape`."""
    return math.prod(shape[a] for a in config.sharding.rules.get(logical, ()))


def _gradient_reductions(dense: float, experts: float, count: int, shape: dict[str, int],
                         dcn: dict[str, int]) -> list[Collective]:
    """All-reduces of the gradients (bytes per device of the dense and the expert weights) over
    the axes that hold replicas: the dense weights' over data, context and expert (rows and
    tokens split there, weights do not), the experts' over data and context."""
    found = []
    for size, axes in ((dense, ("data", "context", "expert")), (experts, ("data", "context"))):
        axes = tuple(a for a in axes if shape[a] > 1)
        if axes and size:
            found.append(Collective("all-reduce", int(size), count, axes,
                                    math.prod(shape[a] for a in axes),
                                    any(dcn.get(a, 1) > 1 for a in axes)))
    return found


def _layer_params(spec: ModelSpec) -> int:
    """Parameters of the stacked layers (what pipeline stages split)."""
    return sum(a.size for a in jax.tree.leaves(spec.abstract_params["blocks"]))


def _expert_params(spec: ModelSpec) -> int:
    """Parameters of the MoE layers' experts (what the expert axis splits)."""
    m = spec.config
    return m.moe_layers * m.moe.experts * 3 * m.d_model * m.mlp_dim if m.moe else 0


def step_time(config: ml_collections.ConfigDict, spec: ModelSpec, candidate: Candidate,
              collectives: Sequence[Collective], chip: Chip, num_devices: int,
              bytes_accessed: int | None = None) -> StepTime:
    """`bytes_accessed`: what the compiled program reads and writes per device per step (None
    when not compiled: no memory term)."""
    compute, model_flops = compute_seconds(config, spec, candidate, num_devices,
                                           chip.peak_bf16_flops)
    overlapped = exposed = 0.0
    for c in collectives:
        bandwidth = chip.network if c.crosses_dcn else chip.fast_link_bandwidth
        seconds = c.link_bytes * c.count / bandwidth
        if _exposed(c):
            exposed += seconds
        else:
            overlapped += seconds
    bubble = candidate.pipeline.bubble_fraction() if candidate.pipeline else 0.0
    memory = None if bytes_accessed is None else bytes_accessed / chip.hbm_bandwidth
    return StepTime(compute, overlapped, exposed, model_flops, bubble, memory)


def _exposed(c: Collective) -> bool:
    """Whether a collective is on the step's critical path: any over `tensor` or `pipeline`, an
    all-to-all (an MoE layer's experts wait for their tokens, the combine for their outputs),
    and a gather or reduce-scatter over `context` (a layer's attention waits for the keys and
    values; their gradients are the backward's next input). The gradients' all-reduces over
    `context` or `expert`, whose replicas they are, overlap like those over `data`."""
    return (any(a in _EXPOSED_AXES for a in c.axes) or c.kind == "all-to-all"
            or (c.kind in ("all-gather", "reduce-scatter") and "context" in c.axes))


def simplicity(candidate: Candidate) -> tuple:
    """Smaller is simpler."""
    return (candidate.axes_used, candidate.pipeline is not None, _REMAT_ORDER[candidate.remat],
            candidate.step_preference, candidate.microbatches, candidate.pipeline_microbatches,
            candidate.schedule == "1f1b", candidate.optimizer_state != "params",
            candidate.mesh_shape["tensor"])


def best(rows: Sequence) -> object:
    """The row to choose (rows have `.time`, `.candidate` and `.bytes`): among those within
    NEAR_TIE of the fastest, the simplest, then the one with the most memory to spare."""
    fastest = min(r.time.total for r in rows)
    close = [r for r in rows if r.time.total <= fastest * (1 + NEAR_TIE)]
    return min(close, key=lambda r: (simplicity(r.candidate), r.time.total, r.bytes))
