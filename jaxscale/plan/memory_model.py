"""An analytic estimate of a train step's memory per device, for pruning candidates before any
compile (compiling one Llama 3 8B layout for a TPU slice takes minutes; this takes microseconds).

What it counts, per device:
  - state: float32 parameters and the optimizer's moments, each split as its sharding says
    (exact: computed from every parameter's shape and PartitionSpec);
  - gradients and the optimizer's update: float32 copies of the parameters in the moments'
    layout (one more with gradient accumulation: the running sum);
  - gathered weights: under FSDP one layer's weights, gathered in the compute dtype, twice (the
    compiler prefetches the next layer's while the current one runs);
  - activations of one microbatch: what the backward pass keeps per layer under the remat
    policy, plus one layer's working set during its backward pass, plus the attention scores
    where the XLA path materialises them (CPUs and GPUs; TPUs use the splash kernel);
  - the loss: float32 logits of `model.loss_chunk_len` positions at a time (jaxscale/loss.py).
With S pipeline stages (jaxscale/parallel/pipeline.py) the state is split S ways by the sharding
specs themselves (`layers` -> `pipeline`), and the activations are those of the device's L/S
layers on microbatches of 1/M of the rows, as the schedule keeps them (`_pipeline_activations`).
The coefficients are per-tensor counts read off jaxscale/models/layers.py; the planner reports
the estimate beside the compiler's figure for every candidate it compiles (docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec as P

from jaxscale.loss import chunk_length
from jaxscale.parallel.pipeline import Pipeline, config_pipeline
from jaxscale.parallel.sharding import logical_to_mesh, rules_from_config, spec_axes
from jaxscale.state import ModelSpec, moment_specs
from jaxscale.step import BATCH_KEYS


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device, by what holds them."""
    params: int
    moments: int
    batch: int
    gradients: int
    gathered_weights: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


def _shard_elements(shape, spec: P, mesh_shape: Mapping[str, int]) -> int:
    """Elements of one device's shard of an array of `shape` split as `spec`."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    total = 1
    for size, entry in zip(shape, entries):
        total *= -(-size // math.prod(mesh_shape[a] for a in spec_axes(entry)))
    return total


def _tree_shard_elements(specs, abstract, mesh_shape) -> int:
    return sum(jax.tree.leaves(jax.tree.map(
        lambda spec, a: _shard_elements(a.shape, spec, mesh_shape), specs, abstract,
        is_leaf=lambda x: isinstance(x, P))))


def estimate_memory(config: ml_collections.ConfigDict, spec: ModelSpec,
                    mesh_shape: Mapping[str, int], splash_attention: bool) -> MemoryEstimate:
    """Bytes per device of `config`'s train step on a mesh of `mesh_shape` (each axis its ICI
    size times its DCN factor). `splash_attention`: the attention kernel keeps no scores."""
    rules = rules_from_config(config.sharding.rules)
    m, t, cfg = config.model, config.train, spec.config
    param_specs = jax.tree.map(lambda logical: logical_to_mesh(logical, rules), spec.logical_specs,
                               is_leaf=lambda x: isinstance(x, P))
    params = _tree_shard_elements(param_specs, spec.abstract_params, mesh_shape)
    moment_elements = _tree_shard_elements(
        moment_specs(spec, rules, mesh_shape, config.sharding.optimizer_state),
        spec.abstract_params, mesh_shape)
    moment_bytes = jnp.dtype(config.optim.moment_dtype).itemsize
    compute = jnp.dtype(config.precision.compute_dtype).itemsize

    def shards(logical: str) -> int:
        return math.prod(mesh_shape[a] for a in rules.get(logical, ()))

    batch_shards = shards("batch")
    rows = max(t.batch_size // t.microbatches // batch_shards, 1)  # one microbatch, per device
    pipeline = config_pipeline(config, mesh_shape["pipeline"])
    # With a pipeline, a stage works on 1/M of those rows at a time.
    stage_rows = max(rows // pipeline.num_microbatches, 1) if pipeline else rows
    # Per-device widths of the layer's tensors (the tensor axis splits heads and the MLP).
    d = m.d_model
    q = m.n_heads * m.head_dim // shards("heads")
    kv = m.n_kv_heads * m.head_dim // shards("kv_heads")
    mlp = m.mlp_dim // shards("mlp")
    heads = max(m.n_heads // shards("heads"), 1)

    # Per layer, bytes per token of everything the forward pass makes: the norms' float32 inputs
    # and their outputs, residuals, q/k/v (RoPE in float32), the attention output and its
    # projection, the MLP's gate and up projections, its float32 activation and their product.
    everything = (d * (2 * 4 + 5 * compute) + (q + 2 * kv) * compute + (q + kv) * 4
                  + q * compute + mlp * (3 * compute + 4))
    # What the policies keep between the passes, per layer and token: everything, the layer's
    # input, or the input and the outputs of the weight matmuls.
    kept = {"none": everything, "full": d * compute,
            "save_dots": (3 * d + q + 2 * kv + 2 * mlp) * compute}[m.remat]

    def scores(n_rows: int) -> int:
        """The XLA path's float32 scores and probabilities of one layer on `n_rows` rows."""
        return 0 if splash_attention else n_rows * heads * t.seq_len ** 2 * 8

    def layer_kept(n_rows: int) -> int:
        """What one layer keeps for its backward pass (the scores too, without remat)."""
        return kept * n_rows * t.seq_len + (scores(n_rows) if m.remat == "none" else 0)

    def working_set(n_rows: int) -> int:
        """One layer recomputed and differentiated at a time: its activations, their gradients."""
        return 2 * everything * n_rows * t.seq_len + scores(n_rows)

    if pipeline is None:
        activations = m.n_layers * layer_kept(rows) + working_set(rows)
    else:
        stage_weights = _tree_shard_elements(param_specs["blocks"],
                                             spec.abstract_params["blocks"], mesh_shape)
        activations = _pipeline_activations(
            pipeline, m.n_layers // pipeline.stages, layer_kept(stage_rows),
            working_set(stage_rows), stage_weights * compute,
            stage_rows * t.seq_len * d * compute)

    chunk = chunk_length(t.seq_len, m.loss_chunk_len)
    vocab = cfg.padded_vocab_size // shards("vocab")
    # 1F1B computes the loss inside its loop, a microbatch at a time; otherwise after the layers.
    loss_rows = stage_rows if pipeline and pipeline.schedule == "1f1b" else rows
    # A chunk's float32 logits, and half as much again for their gradient (fused with the
    # softmax, partly in place; calibrated on the TPU compiler's Llama 3 1B and 8B steps), plus
    # the features' float32 copy.
    logits = int(loss_rows * chunk * vocab * 4 * 1.5) + loss_rows * t.seq_len * d * 4

    fsdp_gathered = 0
    if shards("embed") > 1:  # the output head is not gathered: the loss contracts it in slices
        layer_elements = d * (q + 2 * kv) + q * d + 3 * d * mlp
        fsdp_gathered = 2 * layer_elements * compute
    # The gradients, the optimizer's update (float32, in the moments' layout) and, with
    # accumulation, the running sum; GPipe's backward loop keeps one too (its gradient carry,
    # in the stage layout), where 1F1B's carry becomes the gradients.
    running_sum = t.microbatches > 1 or (pipeline is not None and pipeline.schedule == "gpipe")
    gradients = 4 * moment_elements * (3 if running_sum else 2)
    return MemoryEstimate(
        params=4 * params, moments=2 * moment_bytes * moment_elements,
        batch=len(BATCH_KEYS) * 4 * rows * t.microbatches * t.seq_len,
        gradients=gradients, gathered_weights=fsdp_gathered, activations=activations,
        logits=logits)


def _pipeline_activations(pipeline: Pipeline, stage_layers: int, layer_kept: int,
                          working_set: int, stage_weights: int, stage_input: int) -> int:
    """Bytes of activations per device of a pipeline stage of `stage_layers` layers, from one
    microbatch's figures: what a layer keeps for its backward (`layer_kept`), one layer's
    backward working set, the stage's weights in the compute dtype, and the stage's input.

    GPipe differentiates through its loop of R*M + S - 1 ticks: every tick keeps what its layers
    keep for the backward. With one repeat the stage's weights are loop constants, kept once in the
    compute dtype; with circular repeats each tick picks its repeat's group, and autodiff keeps
    that copy per tick. 1F1B keeps only the
    stage inputs in flight (at most 2S - 1) and, for the whole batch, the gradient of the stage
    inputs; each tick recomputes one microbatch's stage and differentiates it.
    """
    s, m, r = pipeline.stages, pipeline.num_microbatches, pipeline.repeats
    if pipeline.schedule == "1f1b":
        in_flight = min(m, 2 * s - 1) * stage_input
        return (in_flight + m * stage_input + stage_layers * layer_kept + stage_weights
                + working_set)
    ticks = r * m + s - 1
    weights = ticks * (stage_weights // r) if r > 1 else stage_weights
    return ticks * (stage_layers // r * layer_kept) + weights + working_set
