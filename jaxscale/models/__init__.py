"""The model: a Flax NNX Llama built from a `LlamaConfig` the caller makes; its parameter count."""

from __future__ import annotations

import math

import jax
from flax import nnx

from jaxscale.models.llama import REMAT_POLICIES, Llama, LlamaConfig

__all__ = ["REMAT_POLICIES", "Llama", "LlamaConfig", "abstract_model", "count_params",
           "create_model"]

# Parameters are created unsharded and placed by the trainer's jit out_shardings; Flax's eager
# sharding would need a mesh at construction time, which model code must not know about.
nnx.use_eager_sharding(False)


def create_model(config: LlamaConfig, seed) -> nnx.Module:
    """The model with freshly initialised float32 parameters; `seed` may be traced."""
    return Llama(config, nnx.Rngs(params=jax.random.key(seed)))


def abstract_model(config: LlamaConfig) -> nnx.Module:
    """The model with shapes and logical axes but no allocated parameters."""
    return nnx.eval_shape(lambda: create_model(config, 0))


def count_params(model: nnx.Module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
