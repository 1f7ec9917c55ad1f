"""Mixtral (8x7B, 8x22B): Mistral's decoder, without its sliding window, whose every
feed-forward is a mixture of SwiGLU experts (jaxscale/models/moe.py) behind a top-k router, the
top-k probabilities renormalised to sum to 1.

transformers' MixtralForCausalLM names the attention and norms as LlamaForCausalLM does; each
layer's router is `block_sparse_moe.gate` ([experts, d_model]) and each expert's gate, down and
up weights are `block_sparse_moe.experts.N.w1`, `w2` and `w3`, which jaxscale stacks on the
`experts` axis (jaxscale/models/hf_layout.py `with_experts`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxscale.models.decoder import Decoder, DecoderConfig
from jaxscale.models.decoder import hf_tensors as decoder_tensors
from jaxscale.models.hf_layout import HfTensor, with_experts

EXPERT = "block_sparse_moe.experts.{expert}."


@dataclasses.dataclass(frozen=True)
class MixtralConfig(DecoderConfig):
    family: ClassVar[str] = "mixtral"


def hf_tensors(cfg: MixtralConfig) -> list[HfTensor]:
    """The decoder's tensors with each layer's router and experts for its feed-forward."""
    return with_experts(decoder_tensors(dataclasses.replace(cfg, moe=None)), cfg,
                        "block_sparse_moe.gate.weight",
                        tuple(EXPERT + f"{w}.weight" for w in ("w1", "w3", "w2")))


# The family's door (jaxscale/models/__init__.py): what jaxscale/models/spec.py builds it from.
Config, Model = MixtralConfig, Decoder
