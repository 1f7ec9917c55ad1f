"""An analytic estimate of a train step's memory per device, for pruning candidates before any
compile (compiling one Llama 3 8B layout for a TPU slice takes minutes; this takes microseconds).

What it counts, per device:
  - state: float32 parameters and the optimizer's moments, each split as its sharding says
    (exact: computed from every parameter's shape and PartitionSpec); with the moments offloaded
    to the host, what the streamed update holds: one layer's of the largest stacked parameter
    and those of the IN_FLIGHT largest others;
  - gradients and the optimizer's update: float32 copies of the parameters in the moments'
    layout (one more with gradient accumulation: the running sum);
  - weights in the compute dtype: under FSDP one layer's weights, gathered, twice (the compiler
    prefetches the next layer's while the current one runs); with MoE layers, the device's
    experts of every layer;
  - activations of one microbatch: what the backward pass keeps per layer under the remat
    policy, plus one layer's working set during its backward pass, plus the attention scores
    where the XLA path materialises them (CPUs, a context axis, GPUs without cuDNN's kernel; TPUs
    use splash). Not counted: the workspace of cuDNN's packed layout (`data.max_segments`);
  - the loss: float32 logits of `model.loss_chunk_len` positions and `model.loss_vocab_tile`
    entries of the vocabulary at a time (training/loss.py; the planner estimates a candidate
    with its step settings set, jaxscale/training/step_settings.py).
MoE layers (jaxscale/models/moe.py) add their dispatch buffers [rows, experts, capacity, d_model]
in both layouts, the experts' hidden activations and the router's logits (`_moe_row`); the
expert axis splits the experts' weights and moments (their sharding specs say so) and the rows.
With LoRA on the experts, the weights their adapters are folded into (`_folded_experts`).
A context axis splits every row's tokens, and each layer all-gathers the whole row's keys and
values; its attention is the XLA path's, whose scores are [rows, heads, tokens / C, tokens].
With S pipeline stages (jaxscale/parallel/pipeline.py) the state is split S ways by the sharding
specs themselves (`layers` -> `pipeline`), and the activations are those of the device's L/S
layers on microbatches of 1/M of the rows, as the schedule keeps them (`_pipeline_activations`).
The coefficients are per-tensor counts read off jaxscale/models/layers.py; the planner reports
the estimate beside the compiler's figure for every candidate it compiles (docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import PartitionSpec as P

from jaxscale.models.spec import ModelSpec
from jaxscale.parallel.pipeline import Pipeline, config_pipeline
from jaxscale.parallel.sharding import Rules, spec_axes
from jaxscale.training.layout import StateLayout
from jaxscale.training.loss import chunk_length, vocab_tiles
from jaxscale.training.optim import IN_FLIGHT
from jaxscale.training.step import BATCH_KEYS


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
    folded_experts: int  # LoRA on a mixture's experts: the weights with their adapters folded in

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


def _leaf_shard_elements(specs, abstract, mesh_shape) -> list[int]:
    """Elements of one device's shard of each array of `abstract`, split as `specs` says."""
    return jax.tree.leaves(jax.tree.map(
        lambda spec, a: _shard_elements(a.shape, spec, mesh_shape), specs, abstract,
        is_leaf=lambda x: isinstance(x, P)))


def _tree_shard_elements(specs, abstract, mesh_shape) -> int:
    return sum(_leaf_shard_elements(specs, abstract, mesh_shape))


def estimate_memory(config: ml_collections.ConfigDict, spec: ModelSpec,
                    mesh_shape: Mapping[str, int], attention_kernel: str,
                    packed_layout: int = 0) -> MemoryEstimate:
    """Bytes per device of `config`'s train step on a mesh of `mesh_shape` (each axis its ICI
    size times its DCN factor). `attention_kernel`: what `model.attention` runs on the target
    for this mesh (jaxscale/parallel/attention.py `auto_kernel`): xla, splash or cudnn;
    `packed_layout`: the bound cuDNN's packed layout runs with (0: its mask form)."""
    m, t, cfg = config.model, config.train, spec.config
    # As the train state holds them (with LoRA the adapters split like their weights).
    placed = StateLayout.of(config, mesh_shape, spec)
    rules = placed.rules
    specs = placed.params
    params = _tree_shard_elements(specs, spec.abstract_params, mesh_shape)
    # With LoRA only the adapters are trained: float32 with moments and gradients; the frozen
    # base is held in the compute dtype.
    trained = _tree_shard_elements(spec.trained(specs), spec.trained(spec.abstract_params),
                                   mesh_shape)
    moment_leaves = _leaf_shard_elements(placed.moments, spec.trained(spec.abstract_params),
                                         mesh_shape)
    moment_elements = sum(moment_leaves)
    moment_bytes = jnp.dtype(config.optim.moment_dtype).itemsize
    # Offloaded, they live on the host and the update streams them through the device
    # (training/optim.py streamed_update): in slices (the stacked layers' a layer at a time),
    # one after another, and the parameters in one slice whole, IN_FLIGHT at a time; counted as
    # the largest slice's beside the IN_FLIGHT largest whole ones'. One copy each, though a
    # parameter's old and new moments may both be alive for a moment.
    counts = jax.tree.leaves(placed.slices)
    largest_slice = max((n // k for n, k in zip(moment_leaves, counts) if k > 1), default=0)
    whole = sorted(n for n, k in zip(moment_leaves, counts) if k == 1)
    on_device = (largest_slice + sum(whole[-IN_FLIGHT:]) if config.optim.offload_state
                 else moment_elements)
    compute = jnp.dtype(config.precision.compute_dtype).itemsize

    def shards(logical: str) -> int:
        return math.prod(mesh_shape[a] for a in rules.get(logical, ()))

    batch_shards = shards("batch")
    rows = max(t.batch_size // t.microbatches // batch_shards, 1)  # one microbatch, per device
    pipeline = config_pipeline(config, mesh_shape["pipeline"])
    # With a pipeline, a stage works on 1/M of those rows at a time.
    stage_rows = max(rows // pipeline.num_microbatches, 1) if pipeline else rows
    # A context axis splits every row's tokens.
    context = shards("length")
    tokens = t.seq_len // context
    layers = _layer_bytes(config, cfg, shards, compute, tokens)

    def scores(n_rows: int) -> int:
        """One layer's attention memory on `n_rows` rows, each device's queries against every
        key. XLA's path: the float32 scores and probabilities of every head, and with a context
        axis its boolean mask. cuDNN's packed layout: the backward's float32 workspace (about 8
        bytes per query, head_dim element and segment slot, measured); its mask form: the
        boolean mask, the bias made of it and the bias's gradient. Splash: none."""
        if attention_kernel == "xla":
            mask = tokens * t.seq_len if context > 1 else 0
            return n_rows * (layers.heads * tokens * t.seq_len * 8 + mask)
        if attention_kernel == "splash":
            return 0
        if packed_layout:
            return n_rows * 8 * packed_layout * tokens * layers.heads * m.head_dim
        return n_rows * tokens * t.seq_len * (1 + 2 * compute)

    def layer_kept(n_rows: int) -> int:
        """What one layer keeps for its backward pass (without remat, XLA's scores too)."""
        kept_scores = scores(n_rows) if m.remat == "none" and attention_kernel == "xla" else 0
        return n_rows * layers.kept + kept_scores

    def working_set(n_rows: int) -> int:
        """One layer recomputed and differentiated at a time: its activations, their gradients."""
        return 2 * layers.everything * n_rows + scores(n_rows)

    if pipeline is None:
        activations = m.n_layers * layer_kept(rows) + working_set(rows)
    else:
        stage_weights = _tree_shard_elements(specs["blocks"],
                                             spec.abstract_params["blocks"], mesh_shape)
        activations = _pipeline_activations(
            pipeline, m.n_layers // pipeline.stages, layer_kept(stage_rows),
            working_set(stage_rows), stage_weights * compute,
            stage_rows * tokens * m.d_model * compute)

    chunk = chunk_length(t.seq_len, m.loss_chunk_len) // context
    # The loss holds one vocabulary tile's logits at a time (training/loss.py).
    vocab = (cfg.padded_vocab_size // vocab_tiles(cfg.padded_vocab_size, m.loss_vocab_tile)
             // shards("vocab"))
    # 1F1B computes the loss inside its loop, a microbatch at a time; otherwise after the layers.
    loss_rows = stage_rows if pipeline and pipeline.schedule == "1f1b" else rows
    # A chunk's float32 logits, and half as much again for their gradient (fused with the
    # softmax, partly in place; calibrated on the TPU compiler's Llama 3 1B and 8B steps), plus
    # the features' float32 copy.
    logits = int(loss_rows * chunk * vocab * 4 * 1.5) + loss_rows * tokens * m.d_model * 4

    # The gradients, the optimizer's update (float32, in the moments' layout) and, with
    # accumulation, the running sum; GPipe's backward loop keeps one too (its gradient carry,
    # in the stage layout), where 1F1B's carry becomes the gradients.
    running_sum = t.microbatches > 1 or (pipeline is not None and pipeline.schedule == "gpipe")
    gradients = 4 * moment_elements * (3 if running_sum else 2)
    return MemoryEstimate(
        params=4 * trained + compute * (params - trained),
        moments=2 * moment_bytes * on_device,
        batch=len(BATCH_KEYS) * 4 * rows * t.microbatches * tokens,
        gradients=gradients,
        gathered_weights=_compute_weights(spec, specs, rules, mesh_shape,
                                          compute < 4) * compute,
        activations=activations, logits=logits,
        folded_experts=_folded_experts(spec, specs, mesh_shape, m.remat, compute))


class _LayerBytes(NamedTuple):
    """Per device and row, bytes of a layer's activations: `everything` its forward pass makes
    (the largest layer's: dense or MoE), `kept` what the remat policy keeps for the backward (the
    mean over the layers), without the attention scores; `heads` on the device."""
    heads: int
    everything: int
    kept: int


def _layer_bytes(config: ml_collections.ConfigDict, cfg, shards, compute: int,
                 tokens: int) -> _LayerBytes:
    """The layers' `_LayerBytes` when a device holds `tokens` of each row."""
    m, seq_len = config.model, config.train.seq_len
    # Per-device widths of the layer's tensors (the tensor axis splits heads and the MLP).
    d = m.d_model
    q = m.n_heads * m.head_dim // shards("heads")
    kv = m.n_kv_heads * m.head_dim // shards("kv_heads")
    mlp = m.mlp_dim // shards("mlp")
    # Per token, everything attention and the norms make: the norms' float32 inputs and
    # outputs, residuals, q/k/v (RoPE in float32), the attention output and its projection.
    attention = (d * (2 * 4 + 5 * compute) + (q + 2 * kv) * compute + (q + kv) * 4
                 + q * compute) * tokens
    # With a context axis, the keys and values of the whole row, all-gathered
    # (jaxscale/parallel/attention.py `_context`): the backward needs them.
    if tokens < seq_len:
        attention += seq_len * 2 * kv * compute
    # The MLP's gate and up projections, its float32 activation and their product (under remat
    # full, of one chunk of its hidden units: `MLP.in_chunks`). What the policies keep between
    # the passes: everything, the layer's input, or the input and the outputs of the weight
    # matmuls.
    dense = attention + mlp // cfg.mlp_chunks * (3 * compute + 4) * tokens
    # LoRA dropout: each adapter's dropped copy of its input and the mask (a byte an element).
    # Without remat the backward keeps them; remat draws them again.
    lora = m.lora
    if lora.rank and lora.dropout:
        inputs = dict(q=d, k=d, v=d, gate=d, up=d, o=q, down=mlp)
        dense += sum(inputs[t] for t in lora.targets) * (compute + 1) * tokens
    kept_dense = {"none": dense, "full": d * compute * tokens,
                  "save_dots": (3 * d + q + 2 * kv + 2 * mlp) * compute * tokens}[m.remat]
    moe_layers = cfg.moe_layers
    everything, kept = dense, kept_dense * (m.n_layers - moe_layers)
    if moe_layers:
        moe, exchanged = _moe_row(cfg.moe, seq_len, tokens, d, mlp, compute)
        moe += attention
        # Without remat the backward needs all but the buffers as they were before each
        # all-to-all (an all-to-all's gradient is another, of the gradient); save_dots keeps
        # attention's weight-matmul outputs, the router's float32 logits and, per slot of the
        # experts' buffers, their gate, up and down outputs.
        slots = _expert_slots(cfg.moe, seq_len, tokens)
        kept_moe = {"none": moe - exchanged, "full": d * compute * tokens,
                    "save_dots": ((3 * d + q + 2 * kv) * compute + cfg.moe.experts * 4) * tokens
                    + slots * (2 * mlp + d) * compute}[m.remat]
        everything = max(dense, moe)
        kept += kept_moe * moe_layers
    return _LayerBytes(max(m.n_heads // shards("heads"), 1), everything, kept // m.n_layers)


def _moe_row(moe, seq_len: int, tokens: int, d: int, mlp: int,
             compute: int) -> tuple[int, int]:
    """Bytes of one row's MoE feed-forward on a device (jaxscale/models/moe.py), and of those the
    buffers that only go into an all-to-all. Per slot of the [experts, capacity] buffers: the
    dispatched tokens in the token and the expert layout and the experts' outputs in both, the
    gate and up projections, their product and the float32 activation; per token, the float32
    input of the router, its logits and probabilities, and the top_k outputs gathered back in
    float32 and weighted. The buffers' capacity is the whole row's and no mesh axis splits it: a
    context axis leaves every device all of its rows' slots."""
    slots = _expert_slots(moe, seq_len, tokens)
    per_slot = 4 * d * compute + mlp * (3 * compute + 4)
    per_token = d * 4 + 2 * moe.experts * 4 + 2 * moe.top_k * d * 4
    return slots * per_slot + tokens * per_token, slots * 2 * d * compute


def _expert_slots(moe, seq_len: int, tokens: int) -> int:
    """The rows the experts run on for a device's `tokens` of a row: the [experts, capacity]
    buffers' slots, or dropless (capacity_factor 0) the device's own assignments, top_k a token,
    which it groups by expert and runs itself (jaxscale/models/moe.py `grouped_swiglu`)."""
    if moe.capacity_factor == 0:
        return tokens * moe.top_k
    return moe.experts * moe.capacity(seq_len)


def _is_expert_weight(logical: P) -> bool:
    """Whether a parameter's logical spec names the experts' axis."""
    return any(name == "experts" for entry in logical for name in spec_axes(entry))


def _compute_weights(spec: ModelSpec, param_specs, rules: Rules, mesh_shape: Mapping[str, int],
                     converted: bool) -> int:
    """Elements per device of weights held in the compute dtype beyond the float32 state. Under
    FSDP, one stacked unit's weights gathered (a layer, or a group of `moe.every` layers), twice:
    the compiler prefetches the next unit's while the current one runs. The output head is not
    gathered: the loss contracts it in slices. With MoE layers and a compute dtype narrower than
    the parameters (`converted`), every layer's local experts: XLA:CPU holds that much more for
    MoE models in bfloat16 and nothing more in float32 (seen in configs/tiny_moe.py's compiled
    step, on data and expert meshes); read as their converted copies, hoisted out of the loop
    over layers."""
    blocks, abstract = param_specs["blocks"], spec.abstract_params["blocks"]
    gathered = 0
    embed_axes = tuple(rules.get("embed", ()))
    if math.prod(mesh_shape[a] for a in embed_axes) > 1:
        whole = dict(mesh_shape) | {a: 1 for a in (*embed_axes, *rules.get("layers", ()))}
        units = jax.tree.leaves(abstract)[0].shape[0]  # the stacked `layers` axis
        gathered = 2 * _tree_shard_elements(blocks, abstract, whole) // units
    gathered += _dropless_experts(spec, blocks, abstract, rules, mesh_shape)
    if not converted:
        return gathered
    experts = jax.tree.leaves(jax.tree.map(
        lambda logical, p, a: _shard_elements(a.shape, p, mesh_shape)
        if _is_expert_weight(logical) else 0,
        spec.logical_specs["blocks"], blocks, abstract, is_leaf=lambda x: isinstance(x, P)))
    return gathered + sum(experts)


def _dropless_experts(spec: ModelSpec, blocks, abstract, rules: Rules,
                      mesh_shape: Mapping[str, int]) -> int:
    """Elements per device of the expert weights that dropless routing with the experts split
    over devices brings whole to the tokens (jaxscale/parallel/experts.py `on_token_shards`):
    every MoE layer's, kept for the backward, and one layer's gradient before it is split back
    (seen in configs/tiny_moe.py's compiled step on data=2 x expert=4)."""
    moe, expert_axes = spec.config.moe, tuple(rules.get("experts", ()))
    if not moe or moe.capacity_factor or math.prod(mesh_shape[a] for a in expert_axes) == 1:
        return 0
    whole = dict(mesh_shape) | {a: 1 for a in expert_axes}
    experts = sum(jax.tree.leaves(jax.tree.map(
        lambda logical, p, a: _shard_elements(a.shape, p, whole)
        if _is_expert_weight(logical) else 0,
        spec.logical_specs["blocks"], blocks, abstract, is_leaf=lambda x: isinstance(x, P))))
    units = jax.tree.leaves(abstract)[0].shape[0]  # the stacked `layers` axis
    return experts + experts // units


def _folded_experts(spec: ModelSpec, param_specs, mesh_shape: Mapping[str, int], remat: str,
                    compute: int) -> int:
    """Bytes per device of the expert weights that LoRA on a mixture's experts folds its adapters
    into (jaxscale/models/moe.py `weight`: W + (alpha / r) A B in float32, then cast to the
    compute dtype): one MoE layer's adapted weights in float32 at a time and, without remat,
    every MoE layer's folded copy in the compute dtype, which the backward's matmuls take. The
    compiled step grew by about that; its other temporaries (the fold's gradient, the cast)
    share the peak of the layer's working set (benchmarks/RESULTS.md, "Figures once kept in
    docstrings")."""
    cfg = spec.config
    if cfg.lora is None or cfg.moe is None:
        return 0
    blocks, abstract = param_specs["blocks"], spec.abstract_params["blocks"]

    def folded(path, logical, p, a) -> int:  # an expert weight with an adapter (not a factor)
        return (_shard_elements(a.shape, p, mesh_shape) if _is_expert_weight(logical)
                and getattr(path[-1], "key", None) in cfg.lora.targets else 0)

    elements = sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(
        folded, spec.logical_specs["blocks"], blocks, abstract,
        is_leaf=lambda x: isinstance(x, P))))
    per_layer = elements // jax.tree.leaves(abstract)[0].shape[0]  # a unit has one MoE layer
    kept = cfg.moe_layers * per_layer * compute if remat == "none" else 0
    return kept + per_layer * 4


def _pipeline_activations(pipeline: Pipeline, stage_layers: int, layer_kept: int,
                          working_set: int, stage_weights: int, stage_input: int) -> int:
    """Bytes of activations per device of a pipeline stage of `stage_layers` layers, from one
    microbatch's figures: what a layer keeps for its backward (`layer_kept`), one layer's
    backward working set, the stage's weights in the compute dtype, and the stage's input.

    GPipe differentiates through its loop of R*M + S - 1 ticks: every tick keeps what its layers
    keep for the backward. With one repeat the stage's weights are loop constants, kept once in the
    compute dtype; with circular repeats each tick picks its repeat's group, and autodiff keeps
    that copy per tick. 1F1B keeps only the
    stage inputs in flight (at most 2S - 1) and an S-th of the microbatches' inputs (each stage
    holds its share, and the input gradient takes its input's slot); each tick recomputes one
    microbatch's stage and differentiates it.
    """
    s, m, r = pipeline.stages, pipeline.num_microbatches, pipeline.repeats
    if pipeline.schedule == "1f1b":
        in_flight = min(m, 2 * s - 1) * stage_input
        return (in_flight + -(-m // s) * stage_input + stage_layers * layer_kept + stage_weights
                + working_set)
    ticks = r * m + s - 1
    weights = ticks * (stage_weights // r) if r > 1 else stage_weights
    return ticks * (stage_layers // r * layer_kept) + weights + working_set
