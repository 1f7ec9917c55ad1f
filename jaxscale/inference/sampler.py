"""Sampling from a model of any family: a jitted prefill that fills the model's KV cache with the
prompt, then one decode step per new token, optionally sharded on a mesh (the model's `constrain`
places the cache and the activations by the logical rules). `python -m jaxscale.sample` is its
command line.

    tokens = Sampler(model, mesh, rules).generate(prompt_ids, max_new_tokens=100,
                                                  temperature=0.8, top_p=0.95, seed=0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxscale.checkpoint import lora_base, restore_params
from jaxscale.config import MESH_AXES
from jaxscale.errors import ConfigError
from jaxscale.models.lora import join_adapters
from jaxscale.models.spec import model_spec, params_on_mesh
from jaxscale.parallel.mesh import build_mesh, resolve_mesh_shape
from jaxscale.parallel.sharding import Rules, tree_shardings, use_rules


def next_token(logits, key, temperature: float, top_p: float, vocab_size: int):
    """ids [batch] drawn from float32 logits [batch, padded_vocab]. Ids >= vocab_size (the
    embedding's padding) are never drawn: `Decoder.logits` already gives them the lowest float32,
    and a high temperature would bring that back within reach, so they are set to -inf here."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    real = jnp.arange(logits.shape[-1]) < vocab_size
    scaled = jnp.where(real, logits / temperature, -jnp.inf)
    if top_p < 1:
        probs = jax.nn.softmax(scaled, axis=-1)
        ranked = jnp.sort(probs, axis=-1)[:, ::-1]
        # A token is in the nucleus when the more likely tokens have less than top_p together;
        # the most likely one always is. Ties with the least likely kept token are kept too.
        before = jnp.cumsum(ranked, axis=-1) - ranked
        least_kept = jnp.min(jnp.where(before < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(probs >= least_kept, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1)


def _generate(graphdef, params, prompt, key, *, max_new_tokens: int, temperature: float,
              top_p: float):
    """tokens [batch, max_new_tokens] following prompt [batch, length]: prefill, then one decode
    step per token; the i-th token is drawn with fold_in(key, i)."""
    model = nnx.merge(graphdef, params)
    batch, length = prompt.shape
    draw = functools.partial(next_token, temperature=temperature, top_p=top_p,
                             vocab_size=model.cfg.vocab_size)
    # The last token is drawn but never fed back: the cache needs no slot for it.
    cache = model.init_cache(batch, length + max_new_tokens - 1)
    features, cache = model.decode(prompt, cache, 0)
    # Logits for the last position only: [batch, 1, vocab], not the whole prompt's.
    first = draw(model.logits(features[:, -1:])[:, 0], jax.random.fold_in(key, 0))

    def step(carry, i):
        token, cache = carry
        features, cache = model.decode(token[:, None], cache, length + i)
        following = draw(model.logits(features)[:, 0], jax.random.fold_in(key, i + 1))
        return (following, cache), token

    (last, _), tokens = jax.lax.scan(step, (first, cache), jnp.arange(max_new_tokens - 1))
    return jnp.concatenate([tokens.T, last[:, None]], axis=1)


class Sampler:
    """A model's parameters on a mesh and its jitted generation program (compiled once per
    max_new_tokens, temperature and top_p; the seed is an argument)."""

    def __init__(self, model: nnx.Module, mesh: Mesh | None = None, rules: Rules | None = None):
        self.graphdef, state = nnx.split(model)
        self.params = nnx.to_pure_dict(state)
        if mesh is not None:
            specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
            self.params = jax.device_put(self.params, tree_shardings(specs, mesh, rules))

        def traced(*args, **settings):
            if mesh is None:
                return _generate(self.graphdef, *args, **settings)
            with use_rules(mesh, rules):  # the model's `constrain` shards the cache and activations
                return _generate(self.graphdef, *args, **settings)

        self._generate = jax.jit(traced,
                                 static_argnames=("max_new_tokens", "temperature", "top_p"))

    def generate(self, prompt, *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, params=None):
        """int32 numpy [batch, max_new_tokens] continuing `prompt` (int [batch, length], every
        row as long). `params`: these instead of the model's, the same tree on the same mesh (a
        training run samples the parameters it has now, with one compiled program)."""
        tokens = self._generate(self.params if params is None else params,
                                np.asarray(prompt, np.int32),
                                jax.random.key(seed), max_new_tokens=max_new_tokens,
                                temperature=float(temperature), top_p=float(top_p))
        return np.asarray(tokens)


def restored_model(config: ml_collections.ConfigDict, source: str, mesh: Mesh,
                   rules: Rules) -> tuple[nnx.Module, str]:
    """(the model of `config` with the parameters of `source`, where they came from): `source` is
    a checkpoint folder (its newest checkpoint) or a Hugging Face folder; the parameters are
    restored straight onto `mesh`. A LoRA run's checkpoint holds its adapters: they join the
    base they were trained on (`lora_base`)."""
    spec = model_spec(config)
    abstract = params_on_mesh(spec, mesh, rules)
    restored = restore_params(source, spec.trained(abstract), spec.config)
    params = restored.params
    if spec.config.lora:
        params = join_adapters(params, lora_base(config, spec, spec.frozen(abstract))[0])
    return nnx.merge(spec.graphdef, params), restored.path


def sampling_mesh(config: ml_collections.ConfigDict, devices) -> Mesh:
    """The run's mesh on these devices, else (it was made for other devices) all on `data`."""
    try:
        ici, dcn = resolve_mesh_shape(config.mesh, len(devices))
    except ConfigError:
        dcn = dict.fromkeys(MESH_AXES, 1)
        ici = {**dcn, "data": len(devices)}
    return build_mesh(ici, dcn, devices)
