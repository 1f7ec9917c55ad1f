"""The decoder every family is: embedding, scanned pre-norm blocks (GQA attention + SwiGLU), norm,
head. A family (jaxscale/models/__init__.py) is a `DecoderConfig` subclass with its fields'
values and its Hugging Face layout; what differs between families (q/k norms, a sliding window,
RoPE) is a field of the config here, which the blocks read.

The blocks are created stacked along a leading `layers` axis and run with `jax.lax.scan`, so compile
time does not grow with depth; `remat` chooses what the backward pass recomputes.

With mixture-of-experts (`DecoderConfig.moe`), every `moe.every`-th block's feed-forward is an MoE
layer. The stack stays homogeneous: its unit is then a `BlockGroup` of `every` blocks whose last
is the MoE one, stacked along `layers` (n_layers / every of them), and the router statistics
travel through the stack in the carry, next to the activations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.models.hf_layout import LAYER, HfTensor
from jaxscale.models.layers import (
    CACHE_AXES,
    MLP,
    MLP_CHUNK,
    WEIGHT_MATMUL,
    Attention,
    KVCache,
    RMSNorm,
    embedding_lookup,
    fewest_parts,
    float32_accumulating,
    param,
    weight_matmul,
    weights_cast_for_use,
)
from jaxscale.models.lora import AdapterDropout, LoraConfig
from jaxscale.models.moe import MoE, MoEConfig, RouterStats
from jaxscale.models.rope import RopeScaling
from jaxscale.parallel.sharding import constrain
from jaxscale.parallel.stack import LayerFn, Stack, scan_layers, scan_layers_overwriting_weights

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of the weight matmuls (named WEIGHT_MATMUL), recompute the rest: norms,
    # activations and the attention scores, which are cheap in FLOPs and big in memory.
    "save_dots": jax.checkpoint_policies.save_only_these_names(WEIGHT_MATMUL),
}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The model's own config, made by the caller (jaxscale/models/spec.py builds it from
    `config.model` and `config.precision`); nothing here knows the app's config or the mesh."""
    family: ClassVar[str]  # its row of jaxscale/models/__init__.py FAMILIES (set by each family)
    vocab_size: int  # the tokenizer's ids
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab_multiple: int = 1  # the embedding's rows are padded to a multiple (shards evenly)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # None: plain RoPE (Decoder 2, Decoder 3)
    max_seq_len: int = 2048  # the longest context the model is meant for (HF's
    # max_position_embeddings); positions are exact up to 2^24 whatever it is
    # The tokens a query attends to, itself included (Mistral's sliding window); 0: all before it.
    sliding_window: int = 0
    # > 0: layers differ (Gemma 3): layer i is global (every earlier token, rope_theta and
    # rope_scaling) when (i + 1) is a multiple of it, the others local (sliding_window, plain
    # RoPE of rope_local_theta). 0: every layer has sliding_window and rope_theta.
    global_every: int = 0
    rope_local_theta: float = 0.0  # the local layers' RoPE base; 0: rope_theta
    # The attention scores' scale is query_pre_attn_scalar ** -0.5 (Gemma's); 0: head_dim's.
    query_pre_attn_scalar: int = 0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False  # an RMSNorm of each head's q and k before RoPE (Qwen3's)
    # The family's fixed choices (Gemma's, set by its config class, not config keys):
    norm_offset: float = 0.0  # every RMSNorm multiplies by offset + scale (`RMSNorm`)
    post_norms: bool = False  # each sub-layer's output is normed before the residual add
    embed_scale: bool = False  # the embeddings are multiplied by sqrt(d_model)
    mlp_activation: str = "silu"  # the feed-forward's gate (layers.ACTIVATIONS)
    remat: str = "none"  # a key of REMAT_POLICIES
    attention: str = "auto"  # jaxscale.parallel.attention.IMPLEMENTATIONS
    # The most runs of one segment id a packed row holds (0: unbounded); a bound lets GPU
    # attention take packed rows in cuDNN's packed layout.
    max_segments: int = 0
    dtype: str = "bfloat16"  # compute dtype
    grad_reduce_dtype: str = "bfloat16"  # see `grad_dtype`
    # > 0: the attention and dense feed-forward matmuls are fp8, with that many steps of amax
    # history (jaxscale/models/fp8.py); 0: they are in the compute dtype.
    fp8_history: int = 0
    moe: MoEConfig | None = None  # None: every feed-forward is dense
    lora: LoraConfig | None = None  # None: no adapters (jaxscale/models/lora.py)
    mlp_chunk: int = MLP_CHUNK  # under remat full, the dense feed-forward's widest chunk
    # Layers per turn of the layer loop (lax.scan's unroll; 0: every layer unrolled, no loop).
    scan_unroll: int = 1

    def __post_init__(self):
        if self.global_every and self.moe is not None:
            raise ConfigError(f"model.global_every={self.global_every} (layers that differ) and "
                              f"model.moe.every={self.moe.every} cannot go together yet; set "
                              "one of them to 0")

    @property
    def mlp_chunks(self) -> int:
        """How many chunks a dense feed-forward makes its hidden units in (`MLP.in_chunks`):
        under remat `full` the fewest of at most `mlp_chunk` each, where they save memory
        (other policies keep what each chunk made for the backward pass anyway); 1 where its
        matmuls are fp8 or have adapters, which take their weights whole."""
        if self.remat != "full" or not MLP.chunkable(self.fp8_history, self.lora):
            return 1
        return fewest_parts(self.mlp_dim, self.mlp_chunk)

    @property
    def grad_dtype(self) -> jnp.dtype:
        """The dtype the gradients of the attention, dense feed-forward and head weights are made
        and reduced across devices in (`weight_matmul`): `grad_reduce_dtype` or the compute
        dtype, whichever is wider; float32 for float16 compute, which neither bfloat16 nor
        float16 holds the other of."""
        return jnp.promote_types(self.dtype, self.grad_reduce_dtype)

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's and the head's row count."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def flops_per_token(self, num_params: int, seq_len: int,
                        trained_params: int | None = None) -> float:
        """Training FLOPs per token, forward plus backward (PaLM, appendix B).

        `6 * N` counts the weight matmuls (2 FLOPs per multiply-add, forward once, backward twice)
        with N the parameters that take part in matmuls: the input embedding is a lookup, not a
        matmul, unless it doubles as the output head. `12 * layers * heads * head_dim * seq_len`
        counts the attention score and value matmuls, which have no parameters.

        With mixture-of-experts, N counts the active parameters only (`active_params`): the
        experts a token is not routed to do no work for it. Capacity slots left empty (or taken
        by padding) are not counted either: they are the layer's overhead, not the model's FLOPs.

        `trained_params` (LoRA: the adapters; None: every parameter): the others are frozen, and
        a frozen weight's backward makes the input's gradient but not its own, so it counts 4.
        """
        embedding = self.padded_vocab_size * self.d_model
        matmul_params = self.active_params(num_params) - (0 if self.tie_embeddings else embedding)
        frozen = 0 if trained_params is None else matmul_params - trained_params
        return (6.0 * matmul_params - 2.0 * frozen
                + 12.0 * self.n_heads * self.head_dim * self.keys_seen(seq_len))

    def keys_seen(self, seq_len: int) -> int:
        """The keys a query's rows of attention scores span in a `seq_len` sequence, summed over
        the layers: all of them, or in a local layer the sliding window's."""
        window = min(seq_len, self.sliding_window or seq_len)
        return sum(window if local else seq_len for local in self.local_layers())

    @property
    def query_scale(self) -> float:
        """q's factor, with the scores' 1 / sqrt(head_dim), making query_pre_attn_scalar's."""
        if not self.query_pre_attn_scalar:
            return 1.0
        return math.sqrt(self.head_dim / self.query_pre_attn_scalar)

    def local_layers(self) -> list[bool]:
        """Whether each layer is local (sliding window, `rope_local_theta`); with no pattern,
        every layer is as `sliding_window` says."""
        if not self.global_every:
            return [bool(self.sliding_window)] * self.n_layers
        return [(i + 1) % self.global_every != 0 for i in range(self.n_layers)]

    @property
    def moe_layers(self) -> int:
        return self.n_layers // self.moe.every if self.moe else 0

    def active_params(self, num_params: int) -> int:
        """Of the model's `num_params` parameters, those one token uses: all but the
        experts - top_k SwiGLU experts of each MoE layer it is not routed to."""
        if self.moe is None:
            return num_params
        unused = (self.moe.experts - self.moe.top_k) * 3 * self.d_model * self.mlp_dim
        return num_params - self.moe_layers * unused


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x)); `mlp` is an `MoE` layer
    when `moe`. With `post_norms` each sub-layer's output is normed too before it is added
    (Gemma's x + norm(attn(norm(x))))."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, moe: bool = False):
        dtype = jnp.dtype(cfg.dtype)
        # Residual-branch outputs start small so the residual stream's scale does not grow with
        # depth (GPT-2 / Decoder practice).
        out_stddev = 0.02 / math.sqrt(2 * cfg.n_layers)
        offset = cfg.norm_offset
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              cfg.rope_theta, out_stddev, dtype, cfg.attention, rngs,
                              rope_scaling=cfg.rope_scaling, max_segments=cfg.max_segments,
                              grad_dtype=cfg.grad_dtype, fp8_history=cfg.fp8_history,
                              lora=cfg.lora, qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
                              window=cfg.sliding_window, norm_offset=offset,
                              query_scale=cfg.query_scale, global_every=cfg.global_every,
                              rope_local_theta=cfg.rope_local_theta)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset)
        self.attn_post_norm, self.mlp_post_norm = (
            (RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset),
             RMSNorm(cfg.d_model, cfg.norm_eps, offset=offset)) if cfg.post_norms else (None, None))
        if moe:
            self.mlp = MoE(cfg.d_model, cfg.mlp_dim, cfg.moe, out_stddev, dtype, rngs, cfg.lora)
        else:
            self.mlp = MLP(cfg.d_model, cfg.mlp_dim, out_stddev, dtype, rngs,
                           grad_dtype=cfg.grad_dtype, fp8_history=cfg.fp8_history,
                           lora=cfg.lora, hidden_chunks=cfg.mlp_chunks,
                           activation=cfg.mlp_activation)

    def __call__(self, x, positions, segment_ids, dropout: AdapterDropout | None = None,
                 layer: jax.Array | None = None) -> tuple[jax.Array, RouterStats | None]:
        """(the block's output, its router's statistics; None for a dense block). `dropout`
        (train step only): on the LoRA adapters' inputs. `layer`: its index (a per-layer
        pattern's, `DecoderConfig.global_every`)."""
        attended = self.attn(self.attn_norm(x), positions, segment_ids, dropout, layer)
        x = x + self.post_norm(self.attn_post_norm, attended)
        # Padding (segment id 0) is no token to route: it would take real tokens' expert slots.
        valid = None if segment_ids is None else segment_ids != 0
        out, stats = self.feed_forward(self.mlp_norm(x), valid, dropout=dropout)
        return constrain(x + self.post_norm(self.mlp_post_norm, out),
                         ("batch", "length", "embed")), stats

    @staticmethod
    def post_norm(norm: RMSNorm | None, out: jax.Array) -> jax.Array:
        return out if norm is None else norm(out)

    def feed_forward(self, x, valid=None, dropless: bool = False,
                     dropout: AdapterDropout | None = None
                     ) -> tuple[jax.Array, RouterStats | None]:
        if isinstance(self.mlp, MoE):
            # Its adapters are folded into the experts: no dropout (check_lora refuses it).
            return self.mlp(x, valid, dropless)
        return self.mlp(x, dropout), None

    def decode(self, x, cache: KVCache, layer, start) -> tuple[jax.Array, KVCache]:
        """The block on tokens at positions start, start + 1, ..., attending through `cache`
        (`Attention.decode`); returns the output and the cache with this layer's new entries."""
        attended, cache = self.attn.decode(self.attn_norm(x), cache, layer, start)
        x = x + self.post_norm(self.attn_post_norm, attended)
        out = self.feed_forward(self.mlp_norm(x), dropless=True)[0]
        x = x + self.post_norm(self.mlp_post_norm, out)
        return constrain(x, ("batch", "length", "embed")), cache


class BlockGroup(nnx.Module):
    """The stack's unit when some layers are MoE: `moe.every` blocks, the last one's
    feed-forward an MoE layer."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        every = cfg.moe.every
        self.layers = nnx.List([Block(cfg, rngs, moe=i == every - 1) for i in range(every)])

    def __call__(self, carry, positions, segment_ids):
        """(x, router statistics summed over the groups before) -> the same after this group."""
        x, stats = carry
        for block in self.layers[:-1]:
            x, _ = block(x, positions, segment_ids)
        x, own = self.layers[-1](x, positions, segment_ids)
        return x, stats.plus(own)


class Decoder(nnx.Module):

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.padded_vocab_size, cfg.d_model), ("vocab", "embed"), 0.02)

        @nnx.split_rngs(splits=self.stack_units)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return BlockGroup(cfg, rngs) if cfg.moe else Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, offset=cfg.norm_offset)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.padded_vocab_size), ("embed", "vocab"), 0.02)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens [batch, length] int -> float32 logits [batch, length, padded_vocab_size].

        `positions` restart at 0 in each packed document and `segment_ids` keep attention inside a
        document; both default to one unpacked sequence per row.
        """
        return self.logits(self.features(tokens, positions, segment_ids)[0])

    @property
    def stack_units(self) -> int:
        """The length of the stacked `layers` axis: blocks, or groups of `moe.every` blocks."""
        return self.cfg.n_layers // (self.cfg.moe.every if self.cfg.moe else 1)

    def features(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, stack: Stack | None = None,
                 dropout: AdapterDropout | None = None
                 ) -> tuple[jax.Array, RouterStats | None]:
        """tokens [batch, length] -> (the final norm's output [batch, length, d_model], which
        `logits` turns into scores over the vocabulary, and the routers' statistics averaged
        over the MoE layers; None when the model has none). The loss calls the two apart, so
        that it can make the float32 logits a slice of the sequence at a time.

        `stack` runs the blocks (by default `default_stack`, or a pipeline schedule from
        `jaxscale.parallel.pipeline`, which splits the same stacked layers over stages).
        `dropout` (the train step's): on the LoRA adapters' inputs."""
        return self.parts(tokens, positions, segment_ids, dropout).features(
            stack or self.default_stack)

    def parts(self, tokens: jax.Array, positions: jax.Array | None = None,
              segment_ids: jax.Array | None = None,
              dropout: AdapterDropout | None = None) -> ModelParts:
        """The model on `tokens` cut where a layer schedule takes over (a scan, or a pipeline's
        stages): the stack's input, the layers as a pure function with their stacked state and
        per-row inputs, then the final norm and the head (`ModelParts`). With MoE the stack's
        carry is the pair (x, router statistics summed so far)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed_tokens(tokens)
        if self.cfg.moe:
            x = (x, RouterStats.zeros(self.cfg.moe.experts))
        layer_fn, stacked, per_row = self.stack_inputs(positions, segment_ids, dropout)
        norm_def, norm_state = nnx.split(self.final_norm)
        return ModelParts(x, layer_fn, stacked, per_row,
                          lambda state, y: nnx.merge(norm_def, state)(y), norm_state,
                          self.cfg.moe_layers, self.head_weight(), HEAD_AXES,
                          functools.partial(logits_from, cfg=self.cfg))

    @property
    def default_stack(self) -> Stack:
        """A `lax.scan` over the layers, `scan_unroll` of them a turn. With remat `full` the
        backward pass recomputes each layer from its input anyway, and writes its weights'
        gradient over its weights in the stack (jaxscale/parallel/stack.py): the same
        gradients, one stack-sized buffer fewer."""
        stack = scan_layers_overwriting_weights if self.cfg.remat == "full" else scan_layers
        return functools.partial(stack, unroll=self.cfg.scan_unroll)

    def stack_inputs(self, positions: jax.Array, segment_ids: jax.Array | None,
                     dropout: AdapterDropout | None = None) -> tuple[LayerFn, Any, tuple]:
        """(the layer function, the stacked state, the per-row inputs) that a `Stack` runs the
        blocks with. With `dropout` each layer's state is the pair (its state, its global
        index): a pipeline stage's slice of the stack then holds its own layers' indices, and
        the masks are those of one device; the rows' dropout keys go with the rows. A per-layer
        pattern (`global_every`) takes the same pairs: the index says which kind a layer is."""
        block_def, block_state = nnx.split(self.blocks)
        block_state = weights_cast_for_use(self.blocks, block_state)
        if dropout is None and not self.cfg.global_every:
            return self.block_fn(block_def), block_state, (positions, segment_ids)
        layers = jnp.arange(self.stack_units, dtype=jnp.int32)
        if dropout is None:
            return self.block_fn(block_def, indexed=True), (block_state, layers), (
                positions, segment_ids)
        return (self.block_fn(block_def, dropout.rate, indexed=True), (block_state, layers),
                (positions, segment_ids, dropout.keys))

    def block_fn(self, block_def: nnx.GraphDef, dropout_rate: float = 0.0,
                 indexed: bool = False) -> LayerFn:
        """(one layer's state, x, positions, segment_ids) -> x: a block (with MoE, a
        `BlockGroup`, whose x is the carry (x, statistics)) as a pure function, with the config's
        remat policy applied (what its backward pass keeps). With a `dropout_rate`, the
        `stack_inputs` of dropout: (one layer's (state, index), x, positions, segment_ids, the
        rows' dropout keys) -> x. Remat recomputes the same masks: they are the keys'. `indexed`
        (with dropout, or a per-layer pattern): each layer's state comes as (state, index)."""
        def run_block(layer_state, x, positions, segment_ids, *row_keys):
            if not indexed:
                out = nnx.merge(block_def, layer_state)(x, positions, segment_ids)
            else:
                layer_state, layer = layer_state
                dropout = AdapterDropout(dropout_rate, row_keys[0]).folded(layer) \
                    if dropout_rate else None
                out = nnx.merge(block_def, layer_state)(x, positions, segment_ids, dropout, layer)
            return out if self.cfg.moe else out[0]  # a Block's router statistics are None

        policy = REMAT_POLICIES[self.cfg.remat]
        if policy is None:
            return run_block
        # The recomputation must not be merged with the forward pass it repeats (XLA's CSE),
        # or nothing is recomputed and nothing saved. In a loop over the layers the two run in
        # different loops and need no barrier (one costs speed); with every layer unrolled they
        # are one program, and every policy compiled to the same memory (benchmarks/RESULTS.md,
        # "GPU programs compiled on the CPU machine").
        unrolled = self.cfg.scan_unroll == 0 or self.cfg.scan_unroll >= self.stack_units
        return jax.checkpoint(run_block, policy=policy, prevent_cse=unrolled)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens [batch, length] -> their embeddings in the compute dtype."""
        dtype = jnp.dtype(self.cfg.dtype)
        x = embedding_lookup(self.embed[...], tokens, dtype)
        if self.cfg.embed_scale:  # Gemma's sqrt(d_model), rounded to the compute dtype as HF's
            x = x * jnp.asarray(math.sqrt(self.cfg.d_model), dtype)
        return constrain(x, ("batch", "length", "embed"))

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` positions (prompt included):
        the windowed layers keep only their window (`KVCache`)."""
        cfg = self.cfg
        windowed = sum(cfg.local_layers()) if cfg.sliding_window else 0

        def zeros(layers, length):
            shape = (layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
            return constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_AXES)
        whole, ring = zeros(cfg.n_layers - windowed, max_len), zeros(
            windowed, min(cfg.sliding_window, max_len))
        return KVCache(k=whole, v=whole, local_k=ring, local_v=ring)

    def decode(self, tokens: jax.Array, cache: KVCache,
               start: jax.Array | int) -> tuple[jax.Array, KVCache]:
        """The cached forward pass: tokens [batch, length] at positions start, start + 1, ...
        (the same in every row), after the `start` positions already in `cache` -> (their
        features, as `features` gives them, and the cache with their keys and values added).
        Prefill is `decode(prompt, init_cache(...), 0)`, each later token
        `decode(token[:, None], cache, position)`; every call attends to the whole cache (a
        windowed layer's: its window), with the positions not yet written masked."""
        x = self.embed_tokens(tokens)
        block_def, block_state = nnx.split(self.blocks)
        per_unit = self.cfg.n_layers // self.stack_units

        def run_unit(carry, first_layer_and_state):
            x, cache = carry
            first_layer, unit_state = first_layer_and_state
            unit = nnx.merge(block_def, unit_state)
            blocks = unit.layers if self.cfg.moe else [unit]
            for i, block in enumerate(blocks):
                x, cache = block.decode(x, cache, first_layer + i, start)
            return (x, cache), None

        first_layers = jnp.arange(0, self.cfg.n_layers, per_unit, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(run_unit, (x, cache), (first_layers, block_state))
        return self.final_norm(x), cache

    def logits(self, features: jax.Array) -> jax.Array:
        """[..., d_model] features -> float32 [..., padded_vocab_size] logits."""
        return logits_from(features, self.head_weight(), self.cfg)

    def head_weight(self) -> jax.Array:
        """The output head [d_model, padded_vocab_size] as `logits_from` takes it: its own
        parameter, or the embedding's transpose when they are tied, in the dtype its gradient is
        reduced in (`DecoderConfig.grad_dtype`) and the parameter's layout. `logits_from` casts it
        to the compute dtype in that layout, so a sharded head is gathered in the compute dtype,
        not in float32, whichever the reduction's."""
        head = self.embed[...].T if self.cfg.tie_embeddings else self.head[...]
        return constrain(head.astype(self.cfg.grad_dtype), HEAD_AXES)


HEAD_AXES = ("embed", "vocab")


class ModelParts(NamedTuple):
    """The model on a batch, cut where a layer schedule takes over (`Decoder.parts`): what a scan
    or a pipeline's stages run, and what comes after them, each a pure function of its state so
    that a schedule can differentiate it where it runs it (1F1B runs the norm and the loss in its
    loop: jaxscale/parallel/pipeline.py `one_f_one_b_loss`)."""
    x: Any  # the stack's input: the embedded tokens (with MoE, the pair (x, zero statistics))
    layer_fn: LayerFn  # (one layer's state, x, *per_row) -> x
    stacked: Any  # the layers' state, stacked on `layers`
    per_row: tuple  # the layers' other inputs, one row each: positions, segment ids, ...
    norm: Callable[[Any, jax.Array], jax.Array]  # (norm_state, the stack's x) -> features
    norm_state: Any
    moe_layers: int  # the MoE layers whose router statistics the stack's carry sums; 0: none
    head: jax.Array  # [d_model, padded_vocab_size] (`Decoder.head_weight`)
    head_axes: tuple[str, ...]  # its logical axes, which its gradient is kept in
    # (features, head, vocab_ids=None) -> float32 logits (`logits_from` with the model's config)
    logits_fn: Callable[..., jax.Array]

    def features(self, stack: Stack) -> tuple[jax.Array, RouterStats | None]:
        """(the final norm's output [batch, length, d_model], the routers' statistics averaged
        over the MoE layers; None without), the layers run by `stack` (`Decoder.default_stack`, or
        a pipeline schedule's, which splits the same stacked layers over stages)."""
        carry = stack(self.layer_fn, self.stacked, self.x, *self.per_row)
        if not self.moe_layers:
            return self.norm(self.norm_state, carry), None
        x, stats = carry
        return self.norm(self.norm_state, x), stats.scaled(1 / self.moe_layers)


def logits_from(features: jax.Array, head: jax.Array, cfg: DecoderConfig,
                vocab_ids: jax.Array | None = None) -> jax.Array:
    """[..., d_model] features x head [d_model, padded_vocab_size] -> float32 logits; or, with
    `vocab_ids` [v], x those columns of the head [d_model, v] (a tile of the vocabulary). The
    padding rows (ids no tokenizer makes) get the lowest float32, so softmax, loss and sampling
    see exactly the real vocabulary. A pure function of its arrays, so the loss can
    differentiate it a slice of the sequence and a tile of the vocabulary at a time."""
    wide = float32_accumulating(jnp.dtype(cfg.dtype))
    logits = weight_matmul("...d,dv->...v", features.astype(wide), head, jnp.float32)
    if cfg.padded_vocab_size > cfg.vocab_size:
        ids = jnp.arange(cfg.padded_vocab_size) if vocab_ids is None else vocab_ids
        logits = jnp.where(ids < cfg.vocab_size, logits, jnp.finfo(jnp.float32).min)
    return constrain(logits, ("batch", "length", "vocab")[-logits.ndim:])


def hf_tensors(cfg: DecoderConfig) -> list[HfTensor]:
    """Every parameter of `cfg`'s model as a Hugging Face Decoder tensor (jaxscale/hf/), in the
    order transformers writes them."""
    if cfg.moe is not None:
        raise JaxscaleError("mixture-of-experts models (model.moe.every > 0) have no Hugging "
                            f"Face {cfg.family} layout; export and import dense models "
                            "(moe.every=0)")
    d, h, kv, hd, f, v = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
                          cfg.vocab_size)
    tensors = [
        HfTensor(("embed",), "model.embed_tokens.weight", (v, d), (0, 1)),
        HfTensor(("blocks", "attn_norm", "scale"), LAYER + "input_layernorm.weight", (d,), (0,)),
        HfTensor(("blocks", "attn", "q"), LAYER + "self_attn.q_proj.weight", (h, hd, d),
                 (2, 0, 1)),
        HfTensor(("blocks", "attn", "k"), LAYER + "self_attn.k_proj.weight", (kv, hd, d),
                 (2, 0, 1)),
        HfTensor(("blocks", "attn", "v"), LAYER + "self_attn.v_proj.weight", (kv, hd, d),
                 (2, 0, 1)),
        HfTensor(("blocks", "attn", "o"), LAYER + "self_attn.o_proj.weight", (d, h, hd),
                 (1, 2, 0)),
        HfTensor(("blocks", "mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight",
                 (d,), (0,)),
        HfTensor(("blocks", "mlp", "gate"), LAYER + "mlp.gate_proj.weight", (f, d), (1, 0)),
        HfTensor(("blocks", "mlp", "up"), LAYER + "mlp.up_proj.weight", (f, d), (1, 0)),
        HfTensor(("blocks", "mlp", "down"), LAYER + "mlp.down_proj.weight", (d, f), (1, 0)),
        HfTensor(("final_norm", "scale"), "model.norm.weight", (d,), (0,)),
    ]
    if not cfg.tie_embeddings:
        tensors.append(HfTensor(("head",), "lm_head.weight", (v, d), (1, 0)))
    return tensors

