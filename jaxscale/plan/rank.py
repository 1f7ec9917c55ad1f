"""Estimated step time of a candidate: compute at the chip's peak plus communication over the
links, and the order the planner prefers.

Compute is the model's FLOPs (`LlamaConfig.flops_per_token`, not `cost_analysis()`, which counts
a scanned layer once) plus what the remat policy recomputes, at peak bf16 FLOP/s: an upper bound
on speed that ranks candidates fairly, since every one runs the same matmuls.

Communication comes from the compiled HLO's collectives when there is one (`collectives.py`),
else from the analytic counts below (GPU targets, and the pre-ranking before compiling). Each
collective's ring traffic goes over the fast links (ICI / NVLink) or, when its groups span slices
or nodes, the network (DCN).

Overlap assumption: collectives over `data` and `fsdp` (gathering the next layer's weights,
reducing gradients) run asynchronously beside the matmuls, as XLA schedules them, so they cost
time only beyond the compute they hide behind; collectives over `tensor` sit between a layer's
matmuls (each needs the previous one's output), so their time adds in full:
    step = max(compute, data/fsdp communication) + tensor communication.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import ml_collections

from jaxscale.plan.chips import Chip
from jaxscale.plan.collectives import Collective
from jaxscale.plan.search import Candidate
from jaxscale.state import ModelSpec

# On near-ties (within this fraction of the fastest) the simpler candidate wins: fewer mesh
# axes, less recomputation, fewer microbatches, no ZeRO-1.
NEAR_TIE = 0.03
_REMAT_ORDER = {"none": 0, "save_dots": 1, "full": 2}


@dataclasses.dataclass(frozen=True)
class StepTime:
    compute: float  # seconds
    overlapped: float  # data/fsdp communication, hidden behind compute up to its length
    exposed: float  # tensor communication, on the critical path
    model_flops: float  # per step, all devices (no recomputation): MFU's numerator

    @property
    def total(self) -> float:
        return max(self.compute, self.overlapped) + self.exposed

    def mfu(self, num_devices: int, peak: float) -> float:
        return self.model_flops / (self.total * num_devices * peak)


def compute_seconds(config: ml_collections.ConfigDict, spec: ModelSpec, remat: str,
                    num_devices: int, peak: float) -> tuple[float, float]:
    """(seconds of matmuls per step at `peak`, model FLOPs per step). Full remat runs the forward
    pass twice (8N instead of 6N per token); save_dots recomputes only attention's score and value
    products (no weights)."""
    t, m = config.train, spec.config
    tokens = t.batch_size * t.seq_len
    per_token = m.flops_per_token(spec.num_params, t.seq_len)
    attention_forward = 4.0 * m.n_layers * m.n_heads * m.head_dim * t.seq_len
    extra = {"none": 0.0, "save_dots": attention_forward,
             "full": per_token / 3}[remat]
    return tokens * (per_token + extra) / (num_devices * peak), tokens * per_token


def analytic_collectives(config: ml_collections.ConfigDict, spec: ModelSpec,
                         candidate: Candidate, granules: int) -> list[Collective]:
    """The collectives a candidate's step makes, counted from the model's shapes (in the
    compute dtype, as the compiled programs move them): per microbatch, FSDP gathers every
    weight twice (forward, backward) and reduce-scatters its gradient; tensor parallelism
    all-reduces a layer's [tokens, d_model] activations twice per pass (after attention and after
    the MLP) over forward, backward and any remat recomputation; data parallelism all-reduces
    the gradients once per step."""
    t, m = config.train, config.model
    shape = candidate.mesh_shape
    data, fsdp, tensor = shape["data"], shape["fsdp"], shape["tensor"]
    k = candidate.microbatches
    compute = jnp.dtype(config.precision.compute_dtype).itemsize
    weights = spec.num_params * compute / tensor  # one device's model slice, gathered
    dcn_data, dcn_fsdp = candidate.dcn
    found = []
    if fsdp > 1:
        found += [Collective("all-gather", int(weights), 2 * k, ("fsdp",), fsdp, dcn_fsdp > 1),
                  Collective("reduce-scatter", int(weights), k, ("fsdp",), fsdp, dcn_fsdp > 1)]
    if data > 1:
        found.append(Collective("all-reduce", int(weights / fsdp), 1, ("data",), data,
                                dcn_data > 1))
    if tensor > 1:
        rows = t.batch_size // k // (data * fsdp)
        passes = 3 if candidate.remat != "none" else 2
        found.append(Collective("all-reduce", rows * t.seq_len * m.d_model * compute,
                                2 * passes * m.n_layers * k, ("tensor",), tensor, False))
    return found


def step_time(config: ml_collections.ConfigDict, spec: ModelSpec, candidate: Candidate,
              collectives: Sequence[Collective], chip: Chip, num_devices: int) -> StepTime:
    compute, model_flops = compute_seconds(config, spec, candidate.remat, num_devices,
                                           chip.peak_bf16_flops)
    overlapped = exposed = 0.0
    for c in collectives:
        bandwidth = chip.network if c.crosses_dcn else chip.fast_link_bandwidth
        seconds = c.link_bytes * c.count / bandwidth
        if "tensor" in c.axes:
            exposed += seconds
        else:
            overlapped += seconds
    return StepTime(compute, overlapped, exposed, model_flops)


def simplicity(candidate: Candidate) -> tuple:
    """Smaller is simpler."""
    return (candidate.axes_used, _REMAT_ORDER[candidate.remat], candidate.microbatches,
            candidate.optimizer_state != "params", candidate.ici[2])


def best(rows: Sequence) -> object:
    """The row to choose (rows have `.time`, `.candidate` and `.bytes`): among those within
    NEAR_TIE of the fastest, the simplest, then the one with the most memory to spare."""
    fastest = min(r.time.total for r in rows)
    close = [r for r in rows if r.time.total <= fastest * (1 + NEAR_TIE)]
    return min(close, key=lambda r: (simplicity(r.candidate), r.time.total, r.bytes))
