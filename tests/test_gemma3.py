"""Gemma 3 (text) through the model door: Hugging Face import and export against transformers'
Gemma3ForCausalLM (random weights built here, nothing downloaded) on a prompt five times the
local layers' window, with local and global layers interleaved as in the published models
(a count of layers no multiple of the period), the KV cache's decoding of it, and the shipped
1B config against the published one.

Needs torch and transformers (the Python 3.12 CI venv skips this file, as test_mistral).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale import hf
from jaxscale.config import default_config
from jaxscale.errors import JaxscaleError
from jaxscale.hf.config import model_section
from jaxscale.models.gemma3 import Gemma3Config
from jaxscale.models.spec import abstract_model
from tests.helpers import (
    assert_shipped_config_is_published,
    exported_like_a_trained_model,
    float64_rotation,
    jitted,
    relative_error,
    saved_with_norms_off_one,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, WINDOW, EVERY, LAYERS = 300, 8, 3, 4  # layers 0, 1, 3 local; 2 global
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 40)).astype(np.int32)
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=12,
            max_position_embeddings=8192, rms_norm_eps=1e-6, sliding_window=WINDOW,
            sliding_window_pattern=EVERY, rope_theta=1e6, rope_local_base_freq=100.0)

# google/gemma-3-1b-pt's config.json (its shapes and settings; ids and dtype left out), in the
# form transformers 4 wrote it.
PUBLISHED_1B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
    hidden_activation="gelu_pytorch_tanh", hidden_size=1152, intermediate_size=6912,
    max_position_embeddings=32768, num_attention_heads=4, num_hidden_layers=26,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
    sliding_window_pattern=6, tie_word_embeddings=True, vocab_size=262144)


# Gemma 3 4B and larger: linear RoPE scaling of the global layers.
LINEAR = {"rope_type": "linear", "factor": 8.0}


def transformers_logits(folder: str, tokens=TOKENS, start: int = 0) -> np.ndarray:
    """The folder's logits for `tokens` at positions start, start + 1, ..., by transformers in
    float64, its RoPE angles too (`float64_rotation`: transformers' float32 angles moved the
    logits at positions past 4096 by 2e-4 of the largest)."""
    model = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.config._attn_implementation = "eager"
    parameters = model.config.rope_parameters.items()
    float64_rotation(model.model.rotary_emb, model.config.head_dim,
                     {kind: p["rope_theta"] for kind, p in parameters},
                     {kind: p["factor"] for kind, p in parameters if p["rope_type"] == "linear"})
    positions = torch.arange(start, start + tokens.shape[1])[None].expand(tokens.shape[0], -1)
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens, dtype=torch.long),
                     position_ids=positions).logits.numpy()


def jaxscale_logits(model, cfg, tokens=TOKENS, start: int = 0) -> np.ndarray:
    positions = jnp.broadcast_to(start + jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(jitted(model, "__call__")(jnp.asarray(tokens), positions)
                      )[..., :cfg.vocab_size]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """A random float32 Gemma3ForCausalLM saved by transformers, its weights large enough that
    attention is far from uniform and its norms' weights away from 0."""
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**TINY, initializer_range=0.3))
    return saved_with_norms_off_one(model, tmp_path_factory.mktemp("gemma3") / "model")


@pytest.fixture(scope="module")
def linear_folder(tmp_path_factory) -> str:
    """As `hf_folder`, with the global layers' RoPE scaled linearly (Gemma 3 4B+)."""
    torch.manual_seed(1)
    model = transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**TINY, rope_scaling=LINEAR, initializer_range=0.3))
    return saved_with_norms_off_one(model, tmp_path_factory.mktemp("gemma3") / "linear")


def test_linear_rope_scaling_past_4096_equals_transformers(linear_folder):
    """Gemma 3 4B+'s linear scaling of the global layers, imported, at positions 4090 onwards:
    transformers' logits; without the scaling (the same weights) they are missed."""
    model, cfg = hf.load_model(linear_folder, compute_dtype="float32")
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 8.0)
    want = transformers_logits(linear_folder, start=4090)
    assert relative_error(jaxscale_logits(model, cfg, start=4090), want) < 1e-5
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    unscaled = dataclasses.replace(cfg, rope_scaling=None)
    model = nnx.merge(nnx.graphdef(abstract_model(unscaled)), params)
    assert relative_error(jaxscale_logits(model, cfg, start=4090), want) > 1e-3


def test_imported_logits_equal_transformers(hf_folder):
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    assert isinstance(cfg, Gemma3Config)
    assert (cfg.sliding_window, cfg.global_every, cfg.rope_local_theta, cfg.rope_theta,
            cfg.query_pre_attn_scalar) == (WINDOW, EVERY, 100.0, 1e6, 12)
    assert cfg.local_layers() == [True, True, False, True]
    assert relative_error(jaxscale_logits(model, cfg), transformers_logits(hf_folder)) < 1e-5


def test_positions_past_4096_equal_transformers(hf_folder):
    """The same prompt at positions 4090 onwards: both RoPE bases and the window where the
    angles are large."""
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    assert relative_error(jaxscale_logits(model, cfg, start=4090),
                          transformers_logits(hf_folder, start=4090)) < 1e-5


@pytest.mark.slow
def test_the_comparison_sees_each_layer_kind(hf_folder):
    """Every layer global, every layer local, the local RoPE base taken for the global one, or
    the default scores' scale: each misses transformers' logits, so the test above can fail on
    the pattern, the RoPE bases and query_pre_attn_scalar."""
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    want = transformers_logits(hf_folder)
    for change in (dict(global_every=1), dict(global_every=LAYERS + 1),
                   dict(rope_theta=100.0), dict(query_pre_attn_scalar=0)):
        other = dataclasses.replace(cfg, **change)
        changed = nnx.merge(nnx.graphdef(abstract_model(other)), params)
        assert relative_error(jaxscale_logits(changed, cfg), want) > 1e-3, change


def test_decoding_with_the_kv_cache_gives_transformers_logits(hf_folder):
    """A prefill of 3 windows, then a token at a time: the local layers see their last WINDOW
    positions, the global one all of them."""
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    decode, logits = jitted(model, "decode"), jitted(model, "logits")
    cache, got = model.init_cache(2, TOKENS.shape[1]), []
    for begin, end in [(0, 3 * WINDOW)] + [(i, i + 1) for i in range(3 * WINDOW, 40)]:
        features, cache = decode(jnp.asarray(TOKENS[:, begin:end]), cache, begin)
        got.append(np.asarray(logits(features))[..., :VOCAB])
    assert relative_error(np.concatenate(got, axis=1), transformers_logits(hf_folder)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["none", "linear"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, scaling):
    """A jaxscale Gemma 3 (random, its norms away from the identity) exported in float32 loads
    as Gemma3ForCausalLM with no missing or unexpected weights and gives jaxscale's logits; it
    imports back bit for bit. With linear RoPE scaling (4B+), past position 4096."""
    config = default_config()
    config.model.update(name="gemma3", vocab_size=VOCAB, d_model=32, n_layers=LAYERS, n_heads=4,
                        n_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=8192,
                        sliding_window=WINDOW, global_every=EVERY, rope_local_theta=100.0,
                        rope_theta=1e6, query_pre_attn_scalar=12, tie_embeddings=True,
                        norm_eps=1e-6)
    config.model.rope_scaling.update(type=scaling, factor=8.0)
    model, cfg, out, exported = exported_like_a_trained_model(config, tmp_path / "model")
    assert (exported["architectures"], exported["sliding_window_pattern"]) == (
        ["Gemma3ForCausalLM"], EVERY)
    assert exported["rope_scaling"] == (LINEAR if scaling == "linear" else None)
    _, info = transformers.Gemma3ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    start = 4090 if scaling == "linear" else 0
    assert relative_error(transformers_logits(out, start=start),
                          jaxscale_logits(model, cfg, start=start)) < 1e-5
    again, cfg_again = hf.load_model(out, compute_dtype="float32")
    assert cfg_again == cfg
    ours, back = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (model, again))
    for params in (ours, back):  # the padded vocabulary rows are not exported
        params["embed"] = params["embed"][:VOCAB]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 ours, back)


def test_shipped_1b_config_is_the_published_model(tmp_path):
    """configs/gemma3_1b.py exports the published config.json's shapes and settings, the
    published config.json imports as its model section, and it has as many parameters as
    transformers' Gemma3ForCausalLM of that config (built without memory); its attention
    spans each layer's keys."""
    spec = assert_shipped_config_is_published(
        "gemma3_1b", PUBLISHED_1B, transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig, tmp_path)
    assert round(spec.num_params / 1e9, 2) == 1.0
    # The planner's attention FLOPs: 22 local layers' rows span the window, 4 global ones all.
    assert spec.config.keys_seen(4096) == 22 * 512 + 4 * 4096


def test_layer_types_no_period_describes_are_refused(tmp_path):
    """transformers 5's `layer_types` read as model.global_every; a list that is no period of
    sliding layers ending in a full one is one error naming it, not a model of other layers."""
    regular = ["sliding_attention"] * 5 + ["full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(
        {**PUBLISHED_1B, "num_hidden_layers": 12, "layer_types": regular * 2}))
    assert model_section(str(tmp_path))["global_every"] == 6
    (tmp_path / "config.json").write_text(json.dumps(
        {**PUBLISHED_1B, "num_hidden_layers": 12, "layer_types": regular + regular[::-1]}))
    with pytest.raises(JaxscaleError, match="are no period of sliding layers"):
        model_section(str(tmp_path))
