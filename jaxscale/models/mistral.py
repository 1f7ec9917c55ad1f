"""Mistral (7B v0.1): the decoder with a sliding window in every layer (`model.sliding_window`,
4096 tokens in v0.1; v0.2 and later have none, their config.json's `sliding_window` null).

Everything else is the Llama's: grouped-query attention without biases, SwiGLU, pre-norm
blocks, plain RoPE, an untied head; transformers' MistralForCausalLM names its tensors as
LlamaForCausalLM does (jaxscale/models/decoder.py `hf_tensors`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxscale.models.decoder import Decoder, DecoderConfig, hf_tensors


@dataclasses.dataclass(frozen=True)
class MistralConfig(DecoderConfig):
    family: ClassVar[str] = "mistral"


# The family's door (jaxscale/models/__init__.py): what jaxscale/models/spec.py builds it from.
Config, Model = MistralConfig, Decoder
__all__ = ["Config", "Model", "hf_tensors", "MistralConfig"]
