"""A run's model, whatever its family: its config from the run's sections, the model itself, and
its abstract form (shapes and logical axes, nothing allocated) as the rest of jaxscale reads it.

    cfg = model_config(config)           # the family's own config (`model.name` picks it)
    model = create_model(cfg, seed)      # float32 parameters
    spec = model_spec(config)            # ModelSpec: graphdef, logical specs, shapes, counts
    abstract = params_on_mesh(spec, mesh, rules)   # what a checkpoint or HF folder is read into
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from types import ModuleType
from typing import Any, NamedTuple

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from jaxscale.models import family
from jaxscale.models.decoder import DecoderConfig
from jaxscale.models.fp8 import Fp8Meta
from jaxscale.models.lora import lora_config, split_adapters
from jaxscale.models.moe import MoEConfig
from jaxscale.models.rope import RopeScaling
from jaxscale.parallel.sharding import Rules, tree_shardings


def family_module(name: str) -> ModuleType:
    """The module of the family `name` (jaxscale/models/__init__.py FAMILIES), imported on first
    use: the table names it without importing it, so that it stays free of JAX."""
    return importlib.import_module(family(name).module)


def rope_scaling(section: ml_collections.ConfigDict) -> RopeScaling | None:
    """`model.rope_scaling` as the model takes it: None for type "none"."""
    if section.type == "none":
        return None
    return RopeScaling(factor=section.factor, low_freq_factor=section.low_freq_factor,
                       high_freq_factor=section.high_freq_factor,
                       original_max_seq_len=section.original_max_seq_len, kind=section.type)


def moe_config(section: ml_collections.ConfigDict) -> MoEConfig | None:
    """`model.moe` as the model takes it: None when no layer is MoE (`every` 0)."""
    if not section.every:
        return None
    return MoEConfig(experts=section.experts, top_k=section.top_k,
                     capacity_factor=section.capacity_factor, every=section.every)


def model_config(config: ml_collections.ConfigDict) -> DecoderConfig:
    """The model's config, of the family `model.name` names, from the run's `model` and
    `precision` sections (and the bound on documents per row that the input pipeline keeps,
    which fused attention needs). Every family's config is a `DecoderConfig` or extends one."""
    m = config.model
    return family_module(m.name).Config(
        vocab_size=m.vocab_size, vocab_multiple=m.vocab_multiple, d_model=m.d_model,
        n_layers=m.n_layers, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
        mlp_dim=m.mlp_dim, rope_theta=m.rope_theta, rope_scaling=rope_scaling(m.rope_scaling),
        max_seq_len=m.max_seq_len, sliding_window=m.sliding_window,
        global_every=m.global_every, rope_local_theta=m.rope_local_theta,
        query_pre_attn_scalar=m.query_pre_attn_scalar, norm_eps=m.norm_eps,
        tie_embeddings=m.tie_embeddings, remat=m.remat, attention=m.attention,
        max_segments=config.data.max_segments, dtype=config.precision.compute_dtype,
        grad_reduce_dtype=config.precision.grad_reduce_dtype, moe=moe_config(m.moe),
        fp8_history=config.precision.fp8_amax_history if config.precision.matmul == "fp8" else 0,
        lora=lora_config(m.lora.rank, m.lora.alpha, m.lora.targets),
        # -1 (chosen for the device, jaxscale/training/step_settings.py) is settled by the
        # training program before it builds the model; a model built outside one (sampling,
        # export, the planner's shapes) trains nothing, and runs a plain loop.
        scan_unroll=m.scan_unroll if m.scan_unroll >= 0 else 1)


def create_model(cfg: DecoderConfig, seed) -> nnx.Module:
    """The model of `cfg`'s family with freshly initialised float32 parameters; `seed` may be
    traced."""
    return family_module(cfg.family).Model(cfg, nnx.Rngs(params=jax.random.key(seed)))


def abstract_model(cfg: DecoderConfig) -> nnx.Module:
    """The model with shapes and logical axes but no allocated parameters."""
    return nnx.eval_shape(lambda: create_model(cfg, 0))


def count_params(model: nnx.Module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


class ModelSpec(NamedTuple):
    """What the rest of jaxscale knows of the model, taken from its abstract (unallocated) form."""
    config: DecoderConfig
    graphdef: nnx.GraphDef  # the model of the params alone: eval, sampling, export
    logical_specs: Any  # same tree as params, leaves are PartitionSpecs of logical axis names
    abstract_params: Any  # same tree, leaves are ShapeDtypeStructs
    num_params: int
    # The model the train step runs: `graphdef`, or with fp8 matmuls the one that also takes
    # the fp8 meta (merged as nnx.merge(train_graphdef, params, fp8)).
    train_graphdef: nnx.GraphDef = None
    fp8_specs: Any = None  # the fp8 meta's logical PartitionSpecs; None without fp8
    abstract_fp8: Any = None  # its ShapeDtypeStructs

    def trained(self, tree: Any) -> Any:
        """The part of a params-shaped tree that training changes (TrainState.params): all of
        it, or with LoRA the adapters."""
        return split_adapters(tree)[0] if self.config.lora else tree

    def frozen(self, tree: Any) -> Any:
        """The rest (TrainState.frozen): with LoRA the base, else None."""
        return split_adapters(tree)[1] if self.config.lora else None

    @property
    def num_trained(self) -> int | None:
        """The parameters training changes, when not all of them (LoRA's adapters); else None."""
        if not self.config.lora:
            return None
        return sum(a.size for a in jax.tree.leaves(self.trained(self.abstract_params)))


def model_spec(config: ml_collections.ConfigDict) -> ModelSpec:
    """`config`'s model in its abstract form, made once per model config (`spec_of`): the
    checks, the program and the planner ask for the same one."""
    return spec_of(model_config(config))


@functools.lru_cache(maxsize=8)
def spec_of(cfg: DecoderConfig) -> ModelSpec:
    """The ModelSpec of a model config. Shared by whoever asks for the same config: its trees
    are read, never changed."""
    # The params-only model: the same parameters in compute-dtype matmuls.
    abstract = abstract_model(dataclasses.replace(cfg, fp8_history=0))
    graphdef, state = nnx.split(abstract)
    spec = ModelSpec(cfg, graphdef, nnx.to_pure_dict(nnx.get_partition_spec(state)),
                     nnx.to_pure_dict(state), count_params(abstract), train_graphdef=graphdef)
    if not cfg.fp8_history:
        return spec
    train_graphdef, _, meta = nnx.split(abstract_model(cfg), nnx.Param, Fp8Meta)
    return spec._replace(train_graphdef=train_graphdef,
                         fp8_specs=nnx.to_pure_dict(nnx.get_partition_spec(meta)),
                         abstract_fp8=nnx.to_pure_dict(meta))


def params_on_mesh(spec: ModelSpec, mesh: Mesh, rules: Rules, dtype: str | None = None) -> Any:
    """The parameters as ShapeDtypeStructs placed on `mesh` by `rules` (in `dtype`, else their
    own): what a checkpoint or a Hugging Face folder is read into, each array born sharded."""
    return jax.tree.map(
        lambda a, sharding: jax.ShapeDtypeStruct(a.shape, dtype or a.dtype, sharding=sharding),
        spec.abstract_params, tree_shardings(spec.logical_specs, mesh, rules))
