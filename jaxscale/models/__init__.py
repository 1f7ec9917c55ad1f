"""Model families behind one door: `model.name` names one of FAMILIES.

A family is a module of this folder that holds its config (a frozen dataclass, `Config`), its
Flax module (`Model`), and the Hugging Face tensor each of its parameters is (`hf_tensors`).
jaxscale/models/spec.py builds any family's model from a run's config; nothing outside this folder
names a family's classes (tests/test_anatomy.py checks it). Every family is the decoder of
jaxscale/models/decoder.py with its own config: Qwen3 adds per-head q/k norms, Mistral a sliding
window, Gemma 3 local and global layers and its norms.

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


FAMILIES = {family.name: family for family in (
    Family("llama", "jaxscale.models.llama", "LlamaForCausalLM", "llama",
           {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}),
    Family("qwen3", "jaxscale.models.qwen3", "Qwen3ForCausalLM", "qwen3",
           {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}),
    Family("mistral", "jaxscale.models.mistral", "MistralForCausalLM", "mistral",
           {"hidden_act": "silu"}, hf_keys={"sliding_window": "sliding_window"}),
    Family("gemma3", "jaxscale.models.gemma3", "Gemma3ForCausalLM", "gemma3_text",
           {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False},
           hf_keys={"sliding_window": "sliding_window", "sliding_window_pattern": "global_every",
                    "rope_local_base_freq": "rope_local_theta",
                    "query_pre_attn_scalar": "query_pre_attn_scalar"}),
)}


def family(name: str) -> Family:
    """The family `model.name` names; ConfigError for another name."""
    if name not in FAMILIES:
        raise ConfigError(f"model.name={name!r} is unknown; use one of {tuple(FAMILIES)}")
    return FAMILIES[name]
