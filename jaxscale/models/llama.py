"""A Llama-style decoder: embedding, scanned pre-norm blocks (GQA attention + SwiGLU), norm, head.

The blocks are created stacked along a leading `layers` axis and run with `jax.lax.scan`, so compile
time does not grow with depth; `remat` chooses what the backward pass recomputes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxscale.models.layers import MLP, Attention, RMSNorm, float32_accumulating, param
from jaxscale.parallel.sharding import constrain

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the outputs of weight matmuls (no batch dimension in the dot), recompute the rest:
    # norms, activations and the attention scores, which are cheap in FLOPs and big in memory.
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The model's own config, made by the caller (the trainer builds it from `config.model` and
    `config.precision`); nothing here knows the app's config or the mesh."""
    vocab_size: int  # the tokenizer's ids
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab_multiple: int = 1  # the embedding's rows are padded to a multiple (shards evenly)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    remat: str = "none"  # a key of REMAT_POLICIES
    dtype: str = "bfloat16"  # compute dtype

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's and the head's row count."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def flops_per_token(self, num_params: int, seq_len: int) -> float:
        """Training FLOPs per token, forward plus backward (PaLM, appendix B).

        `6 * N` counts the weight matmuls (2 FLOPs per multiply-add, forward once, backward twice)
        with N the parameters that take part in matmuls: the input embedding is a lookup, not a
        matmul, unless it doubles as the output head. `12 * layers * heads * head_dim * seq_len`
        counts the attention score and value matmuls, which have no parameters.
        """
        embedding = self.padded_vocab_size * self.d_model
        matmul_params = num_params - (0 if self.tie_embeddings else embedding)
        return 6.0 * matmul_params + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        # Residual-branch outputs start small so the residual stream's scale does not grow with
        # depth (GPT-2 / Llama practice).
        out_stddev = 0.02 / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                              cfg.rope_theta, out_stddev, dtype, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg.d_model, cfg.mlp_dim, out_stddev, dtype, rngs)

    def __call__(self, x, positions, segment_ids):
        x = x + self.attn(self.attn_norm(x), positions, segment_ids)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "embed"))


class Llama(nnx.Module):

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.padded_vocab_size, cfg.d_model), ("vocab", "embed"), 0.02)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.head = param(rngs, (cfg.d_model, cfg.padded_vocab_size), ("embed", "vocab"), 0.02)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """tokens [batch, length] int -> float32 logits [batch, length, padded_vocab_size].

        `positions` restart at 0 in each packed document and `segment_ids` keep attention inside a
        document; both default to one unpacked sequence per row.
        """
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = jnp.take(self.embed[...], tokens, axis=0).astype(dtype)
        x = constrain(x, ("batch", "length", "embed"))

        block_def, block_state = nnx.split(self.blocks)

        def run_block(x, layer_state):
            return nnx.merge(block_def, layer_state)(x, positions, segment_ids), None

        if REMAT_POLICIES[cfg.remat] is not None:
            run_block = jax.checkpoint(run_block, policy=REMAT_POLICIES[cfg.remat],
                                       prevent_cse=False)
        x, _ = jax.lax.scan(run_block, x, block_state)

        x = self.final_norm(x)
        head = self.embed[...].T if cfg.tie_embeddings else self.head[...]
        wide = float32_accumulating(dtype)
        logits = jnp.einsum("btd,dv->btv", x.astype(wide), head.astype(wide),
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("batch", "length", "vocab"))
