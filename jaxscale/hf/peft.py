"""LoRA adapters as a PEFT folder: `save_adapters(adapters, model_config, path)` writes
adapter_config.json and adapter_model.safetensors, which `peft.PeftModel.from_pretrained(base,
path)` loads onto the base's ...ForCausalLM (docs/huggingface.md).

PEFT's LoRA layer computes W x + (lora_alpha / r) B (A x) with torch's [out, in] layouts:
`lora_A.weight` is [r, in] and `lora_B.weight` [out, r]. jaxscale's adapter of a weight has A
[*inputs, r] and B [r, *outputs] with the heads split out (jaxscale/models/lora.py); flattening
them in order gives the [in] and [out] rows of the Hugging Face tensor in the order
jaxscale/hf/weights.py maps the weight itself (no q/k permutation: both use RoPE's "rotate half"
layout), so each factor is a reshape and a transpose. The scale is left to PEFT: r and
lora_alpha are written as the run had them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from jaxscale.errors import JaxscaleError
from jaxscale.hf import safetensors, weights
from jaxscale.models.decoder import DecoderConfig
from jaxscale.models.hf_layout import HfTensor
from jaxscale.models.lora import ADAPTER_SUFFIX, EXPERT_TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the ...ForCausalLM's module names


def _module(tensor: HfTensor) -> str:
    """The torch module of a Hugging Face weight: "model.layers.{}.self_attn.q_proj"."""
    return tensor.hf_name.removesuffix(".weight")


def targets(cfg: DecoderConfig) -> list[HfTensor]:
    """The weights `cfg`'s adapters sit beside, in the order transformers writes them."""
    if cfg.lora is None:
        raise JaxscaleError("the model has no LoRA adapters (model.lora.rank=0); a PEFT folder "
                            "holds adapters: export the whole model instead")
    on_experts = [t for t in cfg.lora.targets if t in EXPERT_TARGETS]
    if cfg.moe is not None and on_experts:
        # transformers' mixtures hold each layer's experts as one fused parameter, not a module
        # per expert that a PEFT LoRA layer could sit on.
        raise JaxscaleError(f"the experts' adapters ({on_experts}) have no PEFT format; export "
                            "the whole model, adapters merged, or train with model.lora.targets "
                            "among ('q', 'k', 'v', 'o')")
    return [t for t in weights.layout(cfg) if t.path[-1] in cfg.lora.targets]


def adapter_config(cfg: DecoderConfig, base_model_name_or_path: str | None,
                   dropout: float = 0.0) -> dict[str, Any]:
    """adapter_config.json: a LoRA of rank r with lora_alpha on the targets' modules (q_proj,
    ..., down_proj), the run's dropout (what PEFT trains on with, should it train these
    further), no biases, every layer."""
    alpha = cfg.lora.alpha
    return dict(
        peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path,
        revision=None, inference_mode=True, r=cfg.lora.rank,
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        target_modules=[_module(t).rsplit(".", 1)[-1] for t in targets(cfg)],
        lora_dropout=dropout, fan_in_fan_out=False, bias="none", use_rslora=False, use_dora=False,
        modules_to_save=None, init_lora_weights=True, layers_to_transform=None,
        layers_pattern=None, rank_pattern={}, alpha_pattern={})


def _factors(cfg: DecoderConfig) -> dict[str, tuple[HfTensor, int, str]]:
    """{PEFT tensor name: (the weight, its layer, "a" or "b")}, layer by layer as PEFT orders
    its state dict."""
    names = {}
    for layer in range(cfg.n_layers):
        for t in targets(cfg):
            module = _PREFIX + _module(t).format(layer)
            names[f"{module}.lora_A.weight"] = (t, layer, "a")
            names[f"{module}.lora_B.weight"] = (t, layer, "b")
    return names


def _adapter(adapters: Any, tensor: HfTensor) -> dict:
    node = adapters
    for key in tensor.path[:-1] + (tensor.path[-1] + ADAPTER_SUFFIX,):
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            raise JaxscaleError(f"the adapters have no {'/'.join(tensor.path)}{ADAPTER_SUFFIX}, "
                                "which the model config targets; pass the model config they were "
                                "made with")
    return node


def save_adapters(adapters: Any, model_config: DecoderConfig, path: str, dtype: str = "bfloat16",
                  *, base_model_name_or_path: str | None = None,
                  dropout: float = 0.0) -> list[str]:
    """Writes `path`/adapter_config.json and adapter_model.safetensors (in `dtype`) from the
    adapters of a params tree (the `*_lora` entries, `lora.split_adapters`; a whole model's
    params do too); `dropout`: the run's `model.lora.dropout`. `path` must not exist or be an
    empty folder. Every process calls it; process 0 writes. Returns the files written."""
    if dtype not in weights.DTYPES:
        raise JaxscaleError(f"dtype {dtype!r} cannot be saved; use one of {weights.DTYPES}")
    rank = model_config.lora.rank if model_config.lora else 0
    factors = _factors(model_config)
    shapes = {}
    for name, (t, _, which) in factors.items():
        a, b = (np.shape(_adapter(adapters, t)[k]) for k in ("a", "b"))
        n_in, n_out = a[1:-1], b[2:]  # past the stacked layers and the rank
        want_a = (model_config.n_layers, *[t.view[p] for p in t.perm][:len(n_in)], rank)
        want_b = (model_config.n_layers, rank, *[t.view[p] for p in t.perm][len(n_in):])
        if (a, b) != (want_a, want_b):
            raise JaxscaleError(f"adapter {'/'.join(t.path)}{ADAPTER_SUFFIX} is a {list(a)}, b "
                                f"{list(b)} but the model config needs a {list(want_a)}, b "
                                f"{list(want_b)}; pass the model config the adapters were made "
                                "with")
        inputs, outputs = int(np.prod(n_in)), int(np.prod(n_out))
        shapes[name] = (rank, inputs) if which == "a" else (outputs, rank)
    if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise JaxscaleError(f"{path!r} exists and is not an empty folder; save to a new folder")
    np_dtype = np.dtype(jax.numpy.dtype(dtype))

    def produce(name: str) -> np.ndarray:
        t, layer, which = factors[name]
        factor = weights.to_host(_adapter(adapters, t)[which][layer])
        if which == "a":  # [*inputs, r] -> [r, in]
            return factor.reshape(-1, rank).T.astype(np_dtype)
        return factor.reshape(rank, -1).T.astype(np_dtype)  # [r, *outputs] -> [out, r]

    names = list(factors)
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
        safetensors.write(os.path.join(path, WEIGHTS_FILE), names, [shapes[n] for n in names],
                          np_dtype, produce)
        with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(adapter_config(model_config, base_model_name_or_path, dropout), f, indent=2)
    else:  # take part in the gathers process 0 makes
        for name in names:
            produce(name)
    return [CONFIG_FILE, WEIGHTS_FILE]
