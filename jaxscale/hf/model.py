"""`load_model` and `save_model`: a Hugging Face folder of a family jaxscale has
(jaxscale/models/__init__.py) as a jaxscale model, and back."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxscale.config import MESH_AXES, default_config
from jaxscale.errors import JaxscaleError
from jaxscale.hf import weights
from jaxscale.hf.config import CONFIG_FILE, apply_model_section, hf_config, model_section
from jaxscale.models.decoder import DecoderConfig
from jaxscale.models.spec import model_spec, params_on_mesh
from jaxscale.parallel.mesh import build_mesh
from jaxscale.parallel.sharding import Rules, rules_from_config


def load_model(path: str, dtype: str = "float32", *, compute_dtype: str = "bfloat16",
               mesh: Mesh | None = None, rules: Rules | None = None
               ) -> tuple[nnx.Module, DecoderConfig]:
    """(model, its config: a DecoderConfig, or its family's extension of one) from a local Hugging
    Face folder of a family jaxscale has (jaxscale/models/__init__.py FAMILIES).

    `dtype`: the parameters' (float32, the training master copy; bfloat16 halves the memory to
    sample). `compute_dtype`: matmuls and activations. With `mesh`, every parameter is sharded by
    `rules` (default: jaxscale's default rules) and each process reads only its devices' slices;
    without, the model lands on the first device. JaxscaleError when the folder is not a model
    jaxscale can load (the message names the file or tensor).
    """
    config = default_config()
    apply_model_section(config, model_section(path))
    config.precision.compute_dtype = compute_dtype
    spec = model_spec(config)
    if mesh is None:  # the first device, as a mesh of one
        single = dict.fromkeys(MESH_AXES, 1)
        mesh = build_mesh(single, single, jax.devices()[:1])
    wanted = params_on_mesh(spec, mesh, rules or rules_from_config(config.sharding.rules), dtype)
    params = weights.load_params(path, spec.config, wanted)
    return nnx.merge(spec.graphdef, params), spec.config


def save_model(model_or_params: nnx.Module | Any, model_config: DecoderConfig, path: str,
               dtype: str = "bfloat16", *, bos_token_id: int | None = None,
               eos_token_id: int | None = None,
               shard_bytes: int = weights.SHARD_BYTES) -> list[str]:
    """Writes `path`/config.json and the weights as safetensors (sharded at `shard_bytes`, with
    model.safetensors.index.json), without the padded vocabulary rows, in `dtype`, so that
    transformers' ...ForCausalLM of the family (its `hf_architecture`) .from_pretrained(path)
    loads them. `path` must not exist or be an empty folder. Every process calls it; process 0
    writes. Returns the weight files."""
    if dtype not in weights.DTYPES:
        raise JaxscaleError(f"dtype {dtype!r} cannot be saved; use one of {weights.DTYPES}")
    params = (nnx.to_pure_dict(nnx.state(model_or_params, nnx.Param))
              if isinstance(model_or_params, nnx.Module) else model_or_params)
    _check_params(params, model_config)
    if os.path.exists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise JaxscaleError(f"{path!r} exists and is not an empty folder; save to a new folder "
                            "(old shards left beside new ones would be loaded too)")
    if jax.process_index() == 0:
        os.makedirs(path, exist_ok=True)
    files = weights.save_params(params, model_config, path, dtype, shard_bytes)
    if jax.process_index() == 0:
        with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump(hf_config(model_config, dtype, bos_token_id, eos_token_id), f, indent=2)
    return files


def _check_params(params: Any, cfg: DecoderConfig) -> None:
    """JaxscaleError naming the first parameter that `cfg`'s model lacks or shapes otherwise."""
    for t in weights.layout(cfg):
        node = params
        for key in t.path:
            node = node.get(key) if isinstance(node, dict) else None
        name = "/".join(map(str, t.path))
        if node is None:
            raise JaxscaleError(f"the params have no {name!r}, which the model config needs; "
                                "pass the model config the params were made with")
        ours = [t.view[p] for p in t.perm]
        vocab_dim = {("embed",): 0, ("head",): 1}.get(t.path)
        if vocab_dim is not None:  # the embedding and head have the padded rows
            ours[vocab_dim] = cfg.padded_vocab_size
        expected = t.lead_shape(cfg.n_layers) + tuple(ours)
        if tuple(np.shape(node)) != expected:
            raise JaxscaleError(f"parameter {name!r} is {list(np.shape(node))} but the model "
                                f"config needs {list(expected)}; pass the model config the params "
                                "were made with")
