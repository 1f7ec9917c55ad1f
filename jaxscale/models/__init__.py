"""Model families behind one door: `model.name` names one of FAMILIES.

A family is a module of this folder that holds its config (a frozen dataclass, `Config`), its
Flax module (`Model`), and the Hugging Face tensor each of its parameters is (`hf_tensors`).
jaxscale/models/spec.py builds any family's model from a run's config; nothing outside this folder
names a family's classes (tests/test_anatomy.py checks it). Every family is the decoder of
jaxscale/models/decoder.py with its own config: Qwen3 adds per-head q/k norms, Mistral a sliding
window, Gemma 3 local and global layers and its norms; Mixtral and Qwen3-MoE have a mixture
of experts in every layer.

This module imports no JAX: jaxscale/hf/config.py reads a Hugging Face config.json with the table
below before JAX starts (a config file, configs/hf.py, does). Adding a family: its module, its row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxscale.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Family:
    """What jaxscale knows of a family without building it."""
    name: str  # model.name
    module: str  # the module with its Config, Model and hf_tensors
    hf_architecture: str  # a Hugging Face config.json's `architectures` entry
    hf_model_type: str  # and its `model_type`
    # The config.json entries the family has one value of: checked on import, written on export.
    hf_settings: Mapping[str, Any]
    # The config.json entries that are `model` keys of the family's own, beyond those every
    # decoder has ({config.json key: model key}; a null or absent entry is the key's 0, none).
    hf_keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # A mixture of experts in every layer: the config.json key of the expert count, which
    # jaxscale/hf/config.py writes (it reads HF's other name for it too); "": a dense family.
    hf_experts: str = ""
    # The config.json key of the feed-forward's (with experts, each expert's) hidden width.
    hf_mlp_dim: str = "intermediate_size"


FAMILIES = {family.name: family for family in (
    Family("llama", "jaxscale.models.llama", "LlamaForCausalLM", "llama",
           {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}),
    Family("qwen3", "jaxscale.models.qwen3", "Qwen3ForCausalLM", "qwen3",
           {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}),
    Family("mistral", "jaxscale.models.mistral", "MistralForCausalLM", "mistral",
           {"hidden_act": "silu"}, hf_keys={"sliding_window": "sliding_window"}),
    # transformers' Mixtral has sliding-window attention too; the published models have none.
    Family("mixtral", "jaxscale.models.mixtral", "MixtralForCausalLM", "mixtral",
           {"hidden_act": "silu", "sliding_window": None}, hf_experts="num_local_experts"),
    # Every layer sparse (no dense layers between), top-k weights renormalised, as in the
    # published Qwen3-30B-A3B and 235B-A22B.
    Family("qwen3_moe", "jaxscale.models.qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe",
           {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
           hf_experts="num_experts", hf_mlp_dim="moe_intermediate_size"),
    Family("gemma3", "jaxscale.models.gemma3", "Gemma3ForCausalLM", "gemma3_text",
           {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False},
           hf_keys={"sliding_window": "sliding_window", "sliding_window_pattern": "global_every",
                    "rope_local_base_freq": "rope_local_theta",
                    "query_pre_attn_scalar": "query_pre_attn_scalar"}),
)}


# The family of a config that names none: the schema's `model.name` is "" (jaxscale/config.py is
# below this package and names no family), and the default config is this family's tiny model.
DEFAULT_FAMILY = "llama"


def family(name: str) -> Family:
    """The family `model.name` names ("": DEFAULT_FAMILY); ConfigError for another name."""
    name = name or DEFAULT_FAMILY
    if name not in FAMILIES:
        raise ConfigError(f"model.name={name!r} is unknown; use one of {tuple(FAMILIES)}")
    return FAMILIES[name]
