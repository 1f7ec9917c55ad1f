"""Llama (2, 3, 3.1+): the decoder as it is (jaxscale/models/decoder.py), whose Hugging Face
tensors (LlamaForCausalLM) are the decoder's own names."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxscale.models.decoder import Decoder, DecoderConfig, hf_tensors


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    family: ClassVar[str] = "llama"


# The family's door (jaxscale/models/__init__.py): what jaxscale/models/spec.py builds it from.
Config, Model = LlamaConfig, Decoder
__all__ = ["Config", "Model", "hf_tensors", "LlamaConfig"]
