"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's decoder (per-head q/k norms) whose every
feed-forward is a mixture of many narrow SwiGLU experts (128 of width 768 in 30B-A3B, 8 chosen
per token; jaxscale/models/moe.py), the top-k probabilities renormalised (`norm_topk_prob`), no
shared expert.

transformers' Qwen3MoeForCausalLM names the attention and norms as Qwen3ForCausalLM does; each
layer's router is `mlp.gate` ([experts, d_model]) and each expert's weights are
`mlp.experts.N.gate_proj`, `up_proj` and `down_proj`, which jaxscale stacks on the `experts` axis
(jaxscale/models/hf_layout.py `with_experts`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxscale.models.decoder import Decoder
from jaxscale.models.hf_layout import HfTensor, with_experts
from jaxscale.models.qwen3 import Qwen3Config
from jaxscale.models.qwen3 import hf_tensors as qwen3_tensors

EXPERT = "mlp.experts.{expert}."


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    family: ClassVar[str] = "qwen3_moe"


def hf_tensors(cfg: Qwen3MoeConfig) -> list[HfTensor]:
    """Qwen3's tensors with each layer's router and experts for its feed-forward."""
    return with_experts(qwen3_tensors(dataclasses.replace(cfg, moe=None)), cfg, "mlp.gate.weight",
                        tuple(EXPERT + f"{w}_proj.weight" for w in ("gate", "up", "down")))


# The family's door (jaxscale/models/__init__.py): what jaxscale/models/spec.py builds it from.
Config, Model = Qwen3MoeConfig, Decoder
