"""Qwen3 (dense): the decoder with an RMSNorm of each head's q and k before RoPE.

Everything else is the shared decoder's (jaxscale/models/decoder.py): grouped-query attention
without biases, head_dim set apart from d_model / n_heads, SwiGLU, pre-norm blocks, plain RoPE
(theta 1e6 in the published models), the embedding tied to the head in the small ones.
transformers' Qwen3ForCausalLM names its tensors as LlamaForCausalLM does, plus `q_norm` and
`k_norm` per layer ([head_dim] each, one scale shared by the heads).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxscale.models.decoder import Decoder, DecoderConfig
from jaxscale.models.decoder import hf_tensors as decoder_tensors
from jaxscale.models.hf_layout import LAYER, HfTensor


@dataclasses.dataclass(frozen=True)
class Qwen3Config(DecoderConfig):
    """The decoder with its attention norming each head's q and k."""
    family: ClassVar[str] = "qwen3"
    qk_norm: bool = True


def hf_tensors(cfg: Qwen3Config) -> list[HfTensor]:
    """The decoder's tensors and each layer's q and k norm scales."""
    norms = [HfTensor(("blocks", "attn", f"{name}_norm", "scale"),
                      LAYER + f"self_attn.{name}_norm.weight", (cfg.head_dim,), (0,))
             for name in ("q", "k")]
    tensors = decoder_tensors(cfg)
    after_o = next(i for i, t in enumerate(tensors) if t.path == ("blocks", "attn", "o")) + 1
    return tensors[:after_o] + norms + tensors[after_o:]


# The family's door (jaxscale/models/__init__.py): what jaxscale/models/spec.py builds it from.
Config, Model = Qwen3Config, Decoder
