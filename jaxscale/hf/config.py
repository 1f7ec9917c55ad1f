"""A Hugging Face model folder's config.json <-> jaxscale's `model` section, and the folder's
tokenizer, for every family jaxscale has (jaxscale/models/__init__.py FAMILIES: the family's
architecture and model_type pick it; its fixed settings are checked and written). No JAX here:
config files (configs/hf.py) import it before JAX may start.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from jaxscale.errors import JaxscaleError, json_object
from jaxscale.hf.bucket_folder import local_folder
from jaxscale.models import FAMILIES, Family
from jaxscale.models.hf_layout import check_moe_in_every_layer
from jaxscale.runtime.storage import filesystem

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FOLDER_HINT = ("point at a local Hugging Face model folder: config.json and model.safetensors "
                "(or model.safetensors.index.json and its shards), as save_pretrained writes")
_TOKENIZER_FIX = "give the tokenizer.json that came with the model"


def is_hf_folder(path: str, key: str) -> bool:
    """Whether `path` (local or a bucket's folder; the config key or flag `key` gave it) looks
    like a Hugging Face model folder (not a jaxscale checkpoint)."""
    fs, root = filesystem(path, key)
    return fs.isfile(f"{root}/{CONFIG_FILE}") and any(
        fs.isfile(f"{root}/{name}") for name in (SINGLE_FILE, INDEX_FILE))


def read_config(path: str) -> tuple[dict[str, Any], Family]:
    """(the folder's config.json, its family); JaxscaleError unless it describes a model of a
    family jaxscale can load."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise JaxscaleError(f"Hugging Face model folder {path!r} does not exist; {_FOLDER_HINT}")
    if not os.path.isfile(file):
        raise JaxscaleError(f"{path!r} has no {CONFIG_FILE}, so it is no Hugging Face model "
                            f"folder; {_FOLDER_HINT}")
    try:
        with open(file, encoding="utf-8") as f:
            hf = json.load(f)
    except ValueError as e:
        raise JaxscaleError(f"{file} is not JSON ({e}); {_FOLDER_HINT}") from None
    json_object(hf, file, _FOLDER_HINT)
    model_type = hf.get("model_type")
    family = next((f for f in FAMILIES.values() if f.hf_model_type == model_type), None)
    architectures = hf.get("architectures") or [family and family.hf_architecture]
    if family is None or architectures != [family.hf_architecture]:
        known = ", ".join(f"{f.hf_model_type!r} with ['{f.hf_architecture}']"
                          for f in FAMILIES.values())
        raise JaxscaleError(
            f"{file}: model_type {model_type!r}, architectures {architectures} is not supported; "
            f"jaxscale imports model_type {known}")
    for key, supported in family.hf_settings.items():
        if hf.get(key, supported) != supported:
            raise JaxscaleError(f"{file}: {key}={hf[key]!r} is not supported; jaxscale's "
                                f"{family.name} has {key}={supported!r}")
    return hf, family


def _rope(hf: dict[str, Any], file: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, model.rope_scaling) from either form: `rope_theta` + `rope_scaling` (written
    by transformers 4) or `rope_parameters` (transformers 5)."""
    if "rope_parameters" in hf:
        params = dict(hf["rope_parameters"] or {})
        # Per layer type (Gemma 3 in transformers 5): the global layers' is rope_theta's.
        params = dict(params.get("full_attention", params))
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        params, theta = dict(hf.get("rope_scaling") or {}), hf.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), dict(type="none")
    if kind not in ("llama3", "linear"):
        raise JaxscaleError(f"{file}: RoPE type {kind!r} is not supported; jaxscale has the "
                            "default RoPE, 'llama3' and 'linear' scaling")
    try:
        if kind == "linear":
            return float(theta), dict(type="linear", factor=float(params["factor"]))
        return float(theta), dict(
            type="llama3", factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_seq_len=int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise JaxscaleError(f"{file}: {kind} RoPE scaling lacks {e.args[0]!r}; add it to the "
                            "rope_scaling (or rope_parameters) entry") from None


def model_section(path: str) -> dict[str, Any]:
    """The folder's model as jaxscale's `config.model` keys (rope_scaling is a group of keys)."""
    hf, family = read_config(path)
    file = os.path.join(path, CONFIG_FILE)
    try:
        d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        theta, rope_scaling = _rope(hf, file)
        return dict(
            name=family.name, vocab_size=int(hf["vocab_size"]), d_model=d_model,
            n_layers=int(hf["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=int(hf.get("head_dim") or d_model // n_heads),
            mlp_dim=int(hf[family.hf_mlp_dim]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            rope_theta=theta, rope_scaling=rope_scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            **_family_keys(hf, file, family),
            **_moe(hf, family, file))
    except KeyError as e:
        raise JaxscaleError(f"{file} lacks {e.args[0]!r}; a {family.name} config.json has it "
                            f"(see transformers' {family.hf_architecture})") from None


def _moe(hf: dict[str, Any], family: Family, file: str) -> dict[str, Any]:
    """{"moe": model.moe's keys} for a family with experts in every layer, routed dropless
    (capacity_factor 0) as transformers routes them; {} for a dense family."""
    if not family.hf_experts:
        return {}
    # transformers reads either name (Qwen3-MoE's config maps num_experts to num_local_experts).
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts is None:
        raise KeyError(family.hf_experts)
    top_k = int(hf["num_experts_per_tok"])
    if top_k == 1:
        # transformers then weighs the one expert by 1; jaxscale by its router probability.
        raise JaxscaleError(f"{file}: num_experts_per_tok=1 is not supported; jaxscale's "
                            f"{family.name} routes each token to 2 experts or more")
    return dict(moe=dict(experts=int(experts), top_k=top_k, every=1, capacity_factor=0.0))


def _number(value) -> int | float:
    """A config.json number as a model key takes it: a null or absent entry is 0."""
    return float(value) if isinstance(value, float) else int(value or 0)


def _family_keys(hf: dict[str, Any], file: str, family: Family) -> dict[str, Any]:
    """The family's own model keys (`Family.hf_keys`), the layers' kinds read in either form."""
    keys = {key: _number(hf.get(hf_key)) for hf_key, key in family.hf_keys.items()}
    if "global_every" in keys:
        keys.update(_layer_kinds(hf, file, int(hf["num_hidden_layers"])))
    return keys


def _layer_kinds(hf: dict[str, Any], file: str, n_layers: int) -> dict[str, Any]:
    """model.global_every and model.rope_local_theta from either form: `layer_types` and
    per-type `rope_parameters` (transformers 5) or `sliding_window_pattern` and
    `rope_local_base_freq` (transformers 4). JaxscaleError for layers no period describes."""
    types = hf.get("layer_types")
    if types is None:
        return dict(global_every=int(hf["sliding_window_pattern"]),
                    rope_local_theta=float(hf["rope_local_base_freq"]))
    every = next((i + 1 for i, kind in enumerate(types) if kind == "full_attention"), 0)
    want = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
            for i in range(n_layers)]
    if types != want:
        raise JaxscaleError(f"{file}: layer_types {types} are no period of sliding layers "
                            "ending in a full one; jaxscale has layer i global when (i + 1) is "
                            "a multiple of model.global_every")
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise JaxscaleError(f"{file}: the sliding layers' RoPE type {local['rope_type']!r} is "
                            "not supported; jaxscale's local layers have the default RoPE")
    theta = local.get("rope_theta", hf.get("rope_local_base_freq"))
    if theta is None:
        raise KeyError("rope_local_base_freq")
    return dict(global_every=every, rope_local_theta=float(theta))


# The model keys that decide the weights' shapes (vocab_size aside: jaxscale may pad it).
_SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
               "tie_embeddings")


def shape_mismatch(path: str, model_config) -> str:
    """'' when the folder's config.json describes the model `model_config` is (shape for
    shape), else the keys that differ as 'd_model=4096 (the config: 64), ...'."""
    section = model_section(path)
    return ", ".join(f"{key}={section[key]} (the config: {getattr(model_config, key)})"
                     for key in _SHAPE_KEYS if section[key] != getattr(model_config, key))


def apply_model_section(config: ml_collections.ConfigDict, section: dict[str, Any]) -> None:
    """Sets `config.model` from `model_section`'s keys (the rope group key by key, as the
    config's validation expects)."""
    section = dict(section)
    config.model.rope_scaling.update(section.pop("rope_scaling"))
    config.model.moe.update(section.pop("moe", dict(every=0)))
    config.model.update(section)


def update_config(config: ml_collections.ConfigDict, path: str, key: str) -> None:
    """Makes `config` fine-tune the folder `path` (local or a bucket's; the flag or config key
    `key` gave it): its model shapes, its tokenizer (tokenizer.json, with config.json's BOS/EOS
    ids as data.bos_token/eos_token) and its weights (checkpoint.restore_from). A bucket's
    folder is read from its local copy, and the config names the bucket's files, which every
    process reads."""
    local = local_folder(path, key)
    apply_model_section(config, model_section(local))
    hf, _ = read_config(local)
    tokenizer = os.path.join(local, TOKENIZER_FILE)
    if os.path.isfile(tokenizer):
        config.data.tokenizer = tokenizer if local == path else f"{path}/{TOKENIZER_FILE}"
        for end in ("bos", "eos"):
            token = _token(tokenizer, hf.get(f"{end}_token_id"))
            config.data[f"{end}_token"] = token or ""
            config.data[f"add_{end}"] = token is not None
    config.checkpoint.restore_from = path


def _moe_keys(c, family: Family) -> dict[str, Any]:
    """config.json's mixture-of-experts entries for `c` (a `DecoderConfig`); {} for a dense
    family."""
    if not family.hf_experts:
        return {}
    check_moe_in_every_layer(c)
    return {family.hf_experts: c.moe.experts, "num_experts_per_tok": c.moe.top_k,
            family.hf_mlp_dim: c.mlp_dim}


def _token(tokenizer: str, token_id: int | list[int] | None) -> str | None:
    """The text of `token_id` (the first, if config.json lists several EOS ids) in a
    tokenizer.json, or None."""
    if isinstance(token_id, list):
        token_id = token_id[0] if token_id else None
    if token_id is None:
        return None
    try:
        with open(tokenizer, encoding="utf-8") as f:
            spec = json.load(f)
    except ValueError as e:
        raise JaxscaleError(f"{tokenizer} is not JSON ({e}); {_TOKENIZER_FIX}") from None
    json_object(spec, tokenizer, _TOKENIZER_FIX)
    for added in spec.get("added_tokens", []):
        if added.get("id") == token_id:
            return added["content"]
    vocab = (spec.get("model") or {}).get("vocab") or {}
    return next((text for text, i in vocab.items() if i == token_id), None) \
        if isinstance(vocab, dict) else None


def hf_config(model_config, dtype: str, bos_token_id: int | None = None,
              eos_token_id: int | None = None) -> dict[str, Any]:
    """config.json for `model_config` (its family's `DecoderConfig`) in the
    `rope_theta` + `rope_scaling` form, which transformers 4 and 5 both read."""
    c, r, family = model_config, model_config.rope_scaling, FAMILIES[model_config.family]
    if c.sliding_window and "sliding_window" not in family.hf_keys.values():
        # transformers would load the weights into a model that attends to every token.
        raise JaxscaleError(f"model.sliding_window={c.sliding_window} has no place in a "
                            f"{family.name} config.json; export a model trained without it")
    rope_scaling = None if r is None else dict(rope_type="linear", factor=r.factor) \
        if r.kind == "linear" else dict(
        rope_type="llama3", factor=r.factor, low_freq_factor=r.low_freq_factor,
        high_freq_factor=r.high_freq_factor,
        original_max_position_embeddings=r.original_max_seq_len)
    config = dict(
        architectures=[family.hf_architecture], model_type=family.hf_model_type,
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        rope_scaling=rope_scaling, tie_word_embeddings=c.tie_embeddings, **family.hf_settings,
        **{hf_key: getattr(c, key) or None for hf_key, key in family.hf_keys.items()},
        torch_dtype=dtype)
    config.update(_moe_keys(c, family))
    config.update({k: v for k, v in (("bos_token_id", bos_token_id),
                                     ("eos_token_id", eos_token_id)) if v is not None})
    return config
