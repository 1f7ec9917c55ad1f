"""Model registry: `config.model.name` -> a Flax NNX module built from the config."""

from __future__ import annotations

import math

import jax
import ml_collections
from flax import nnx

from jaxscale.models.llama import Llama, LlamaConfig

# Parameters are created unsharded and placed by the trainer's jit out_shardings; Flax's eager
# sharding would need a mesh at construction time, which model code must not know about.
nnx.use_eager_sharding(False)


def create_model(config: ml_collections.ConfigDict, seed) -> nnx.Module:
    """The model of `config` with freshly initialised float32 parameters; `seed` may be traced."""
    return Llama(LlamaConfig.from_config(config), nnx.Rngs(params=jax.random.key(seed)))


def abstract_model(config: ml_collections.ConfigDict) -> nnx.Module:
    """The model with shapes and logical axes but no allocated parameters."""
    return nnx.eval_shape(lambda: create_model(config, 0))


def count_params(model: nnx.Module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
