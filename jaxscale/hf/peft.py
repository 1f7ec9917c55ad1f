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

A mixture's experts are one fused parameter per layer in transformers (hf_layout.FUSED_EXPERTS),
which PEFT adapts through `target_parameters`: one LoRA per expert, `lora_A.weight` [experts x
r, in] (expert-major rows) and `lora_B.weight` [out, r x experts] (rank-major columns). The
gate's and the up's adapters share gate_up_proj, so they are one adapter of rank 2r there: A
stacks theirs, B is block-diagonal (the gate's rows against the first r, the up's against the
rest), and `rank_pattern`/`alpha_pattern` give it 2r and 2 x lora_alpha, the same scale.
(PEFT 0.21 warns that those patterns "did not match any targeted module" - it looks among
modules, not parameters - and applies them all the same.)
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import jax
import numpy as np

from jaxscale.errors import JaxscaleError
from jaxscale.hf import safetensors, weights
from jaxscale.models.decoder import DecoderConfig
from jaxscale.models.hf_layout import FUSED_EXPERTS, LAYER, HfTensor
from jaxscale.models.lora import ADAPTER_SUFFIX

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
    return [t for t in weights.layout(cfg) if t.path[-1] in cfg.lora.targets]


def _expert_parameters(cfg: DecoderConfig) -> dict[str, list[HfTensor]]:
    """{fused parameter: the expert weights whose adapters it takes}, as PEFT nests its wrappers
    (gate_up_proj innermost); empty without adapters on experts."""
    experts = {t.path[-1]: t for t in targets(cfg) if t.experts}
    fused = {"gate_up_proj": [experts[n] for n in ("gate", "up") if n in experts],
             "down_proj": [experts["down"]] if "down" in experts else []}
    return {name: tensors for name, tensors in fused.items() if tensors}


def adapter_config(cfg: DecoderConfig, base_model_name_or_path: str | None,
                   dropout: float = 0.0) -> dict[str, Any]:
    """adapter_config.json: a LoRA of rank r with lora_alpha on the targets' modules (q_proj,
    ..., down_proj) and the experts' fused parameters, the run's dropout (what PEFT trains on
    with, should it train these further), no biases, every layer."""
    alpha = cfg.lora.alpha
    fused = _expert_parameters(cfg)
    in_layer = FUSED_EXPERTS.removeprefix(LAYER)  # "mlp.experts"
    # gate and up share gate_up_proj: one adapter of twice the rank, the scale kept.
    doubled = [f"{in_layer.rsplit('.', 1)[-1]}.{name}" for name, ts in fused.items()
               if len(ts) == 2]
    return dict(
        peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base_model_name_or_path,
        revision=None, inference_mode=True, r=cfg.lora.rank,
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        target_modules=[_module(t).rsplit(".", 1)[-1] for t in targets(cfg) if not t.experts],
        target_parameters=[f"{in_layer}.{name}" for name in fused] or None,
        lora_dropout=dropout, fan_in_fan_out=False, bias="none", use_rslora=False, use_dora=False,
        modules_to_save=None, init_lora_weights=True, layers_to_transform=None,
        layers_pattern=None, rank_pattern={key: 2 * cfg.lora.rank for key in doubled},
        alpha_pattern={key: 2 * alpha for key in doubled})


def _name(tensor: HfTensor) -> str:
    """'blocks/layers/0/mlp/gate_lora': where the adapter beside `tensor` lies in the params."""
    return "/".join(map(str, tensor.path)) + ADAPTER_SUFFIX


def _adapter(adapters: Any, tensor: HfTensor) -> dict:
    node = adapters
    for key in tensor.path[:-1] + (tensor.path[-1] + ADAPTER_SUFFIX,):
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            raise JaxscaleError(f"the adapters have no {_name(tensor)}, "
                                "which the model config targets; pass the model config they were "
                                "made with")
    return node


def _check_shapes(adapters: Any, cfg: DecoderConfig) -> None:
    """JaxscaleError unless each targeted weight's adapter has the shapes `cfg` gives it: A
    [*lead, *inputs, r], B [*lead, r, *outputs] (lead: the stacked layers, a mixture's experts)."""
    for t in targets(cfg):
        a, b = (np.shape(_adapter(adapters, t)[k]) for k in ("a", "b"))
        lead, ours = t.lead_shape(cfg.n_layers), [t.view[p] for p in t.perm]
        n_in = len(a) - len(lead) - 1
        want_a = (*lead, *ours[:n_in], cfg.lora.rank)
        want_b = (*lead, cfg.lora.rank, *ours[n_in:])
        if (a, b) != (want_a, want_b):
            raise JaxscaleError(f"adapter {_name(t)} is a {list(a)}, b "
                                f"{list(b)} but the model config needs a {list(want_a)}, b "
                                f"{list(want_b)}; pass the model config the adapters were made "
                                "with")


Factors = dict[str, tuple[tuple[int, int], Callable[[], np.ndarray]]]


def _module_factors(adapters: Any, cfg: DecoderConfig, layer: int) -> Factors:
    """{PEFT tensor name: (its shape, what makes it)} of one layer's modules' adapters: A
    [*inputs, r] -> [r, in], B [r, *outputs] -> [out, r]."""
    rank, factors = cfg.lora.rank, {}
    for t in (t for t in targets(cfg) if not t.experts):
        module, adapter = _PREFIX + _module(t).format(layer), _adapter(adapters, t)
        inputs = int(np.prod(np.shape(adapter["a"])[1:-1]))  # past the layers and before r
        factors[f"{module}.lora_A.weight"] = ((rank, inputs), lambda a=adapter["a"]: (
            weights.to_host(a[layer]).reshape(-1, rank).T))
        factors[f"{module}.lora_B.weight"] = ((int(np.prod(t.hf_shape)) // inputs, rank),
                                              lambda b=adapter["b"]: (
            weights.to_host(b[layer]).reshape(rank, -1).T))
    return factors


def _expert_factors(adapters: Any, cfg: DecoderConfig, layer: int) -> Factors:
    """One layer's experts' adapters as PEFT's on the fused parameters (the module docstring):
    ours are A [experts, in, r] and B [experts, r, out] per weight."""
    factors, fused = {}, _expert_parameters(cfg)
    if not fused:
        return factors
    experts, rank = cfg.moe.experts, cfg.lora.rank
    # Where each weight's rows start: gate_up_proj's are the gate's, then the up's, whether
    # adapted or not.
    starts = {"gate": 0, "up": cfg.mlp_dim, "down": 0}
    for name, tensors in fused.items():
        wrapper = ".base_layer" * (len(fused) - 1 - list(fused).index(name))
        module = _PREFIX + FUSED_EXPERTS.format(layer) + wrapper
        adapters_of = [_adapter(adapters, t) for t in tensors]
        n_in = np.shape(adapters_of[0]["a"])[2]  # past the layers and experts
        out = 2 * cfg.mlp_dim if name == "gate_up_proj" else cfg.d_model
        fused_rank = rank * len(tensors)

        def lora_a(adapters_of=adapters_of):  # [experts, in, r'] -> [experts x r', in]
            a = np.concatenate([weights.to_host(x["a"][layer]) for x in adapters_of], axis=-1)
            return a.transpose(0, 2, 1).reshape(-1, a.shape[1])

        def lora_b(adapters_of=adapters_of, tensors=tensors, out=out, fused_rank=fused_rank):
            b = np.zeros((experts, out, fused_rank), np.float32)
            for i, (t, adapter) in enumerate(zip(tensors, adapters_of)):
                part = weights.to_host(adapter["b"][layer]).transpose(0, 2, 1)
                start = starts[t.path[-1]]
                b[:, start:start + part.shape[1], i * rank:(i + 1) * rank] = part
            return b.transpose(1, 2, 0).reshape(out, -1)  # column k x experts + e

        factors[f"{module}.lora_A.weight"] = ((experts * fused_rank, n_in), lora_a)
        factors[f"{module}.lora_B.weight"] = ((out, fused_rank * experts), lora_b)
    return factors


def save_adapters(adapters: Any, model_config: DecoderConfig, path: str, dtype: str = "bfloat16",
                  *, base_model_name_or_path: str | None = None,
                  dropout: float = 0.0) -> list[str]:
    """Writes `path`/adapter_config.json and adapter_model.safetensors (in `dtype`) from the
    adapters of a params tree (the `*_lora` entries, `lora.split_adapters`; a whole model's
    params do too); `dropout`: the run's `model.lora.dropout`. `path` must not exist or be an
    empty folder. Every process calls it; process 0 writes. Returns the files written."""
    if dtype not in weights.DTYPES:
        raise JaxscaleError(f"dtype {dtype!r} cannot be saved; use one of {weights.DTYPES}")
    _check_shapes(adapters, model_config)
    if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise JaxscaleError(f"{path!r} exists and is not an empty folder; save to a new folder")
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    factors: Factors = {}
    for layer in range(model_config.n_layers):  # layer by layer, as PEFT orders its state dict
        factors |= _module_factors(adapters, model_config, layer)
        factors |= _expert_factors(adapters, model_config, layer)

    def produce(name: str) -> np.ndarray:
        return factors[name][1]().astype(np_dtype)

    names = list(factors)
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
        safetensors.write(os.path.join(path, WEIGHTS_FILE), names,
                          [factors[n][0] for n in names], np_dtype, produce)
        with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(adapter_config(model_config, base_model_name_or_path, dropout), f, indent=2)
    else:  # take part in the gathers process 0 makes
        for name in names:
            produce(name)
    return [CONFIG_FILE, WEIGHTS_FILE]
