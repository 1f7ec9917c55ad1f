"""Gemma 3 (text; transformers' Gemma3ForCausalLM): the decoder with local and global layers.

Every `global_every`-th layer (the 6th, 12th, ... in the published models) attends to every
earlier token with RoPE of `rope_theta`; the others attend to a sliding window with RoPE of
`rope_local_theta`. Beyond that: q/k norms, a GeGLU feed-forward (gelu, tanh approximation),
embeddings scaled by sqrt(d_model), RMSNorms that multiply by (1 + scale), a norm before and after
each sub-layer, attention scores scaled by query_pre_attn_scalar ** -0.5 and the head tied to
the embedding. The (1 + scale) is the parameter here as in HF's files, so a norm's tensor is
read and written as it is; HF calls the norm before the feed-forward `pre_feedforward_layernorm`
and the one after attention `post_attention_layernorm`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxscale.models.decoder import Decoder, DecoderConfig
from jaxscale.models.decoder import hf_tensors as decoder_tensors
from jaxscale.models.hf_layout import LAYER, HfTensor


@dataclasses.dataclass(frozen=True)
class Gemma3Config(DecoderConfig):
    family: ClassVar[str] = "gemma3"
    qk_norm: bool = True
    norm_offset: float = 1.0
    post_norms: bool = True
    embed_scale: bool = True
    mlp_activation: str = "gelu_tanh"


# Our norm -> its tensor's name in a Gemma 3 layer (the decoder names mlp_norm otherwise).
_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
          "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}


def hf_tensors(cfg: Gemma3Config) -> list[HfTensor]:
    """The decoder's tensors with Gemma's four norms a layer and each layer's q and k norms."""
    d, hd = cfg.d_model, cfg.head_dim
    layer = [HfTensor(("blocks", name, "scale"), LAYER + hf_name + ".weight", (d,), (0,))
             for name, hf_name in _NORMS.items()]
    layer += [HfTensor(("blocks", "attn", f"{name}_norm", "scale"),
                       LAYER + f"self_attn.{name}_norm.weight", (hd,), (0,)) for name in "qk"]
    return [t for t in decoder_tensors(cfg) if t.path[-1] != "scale" or t.path[0] != "blocks"] \
        + layer


# The family's door (jaxscale/models/__init__.py): what jaxscale/models/spec.py builds it from.
Config, Model = Gemma3Config, Decoder
