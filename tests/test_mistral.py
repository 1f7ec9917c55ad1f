"""Mistral through the model door: Hugging Face import and export against transformers'
MistralForCausalLM (random weights built here, nothing downloaded) on a prompt five times its
sliding window, the KV cache's decoding of it, and the shipped 7B config against the published
one.

Needs torch and transformers (the `test` extra installs torch's CPU build on Python 3.11 only;
the Python 3.12 CI venv skips this file).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale import hf
from jaxscale.config import default_config
from jaxscale.models.mistral import MistralConfig
from jaxscale.models.spec import abstract_model
from tests.helpers import (
    assert_imports_back_bit_for_bit,
    assert_shipped_config_is_published,
    exported_like_a_trained_model,
    jitted,
    relative_error,
    saved_with_norms_off_one,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, WINDOW = 300, 8
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 40)).astype(np.int32)

# mistralai/Mistral-7B-v0.1's config.json (its shapes and settings; ids and dtype left out).
PUBLISHED_7B = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", hidden_act="silu",
    hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
    num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8, rms_norm_eps=1e-5,
    rope_theta=10000.0, sliding_window=4096, tie_word_embeddings=False, vocab_size=32000)


def transformers_logits(folder: str) -> np.ndarray:
    """The folder's logits for TOKENS, computed by transformers in float64."""
    model = transformers.MistralForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


def jaxscale_logits(model, cfg) -> np.ndarray:
    return np.asarray(model(jnp.asarray(TOKENS)))[..., :cfg.vocab_size]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """A random float32 MistralForCausalLM with a window of WINDOW tokens saved by
    transformers, its weights large enough that attention is far from uniform and its norms away
    from 1, so that a window one token off or a swapped norm moves the logits past 1e-5."""
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
        rms_norm_eps=1e-5, sliding_window=WINDOW, initializer_range=0.3))
    return saved_with_norms_off_one(model, tmp_path_factory.mktemp("mistral") / "model")


def test_imported_logits_equal_transformers(hf_folder):
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    assert isinstance(cfg, MistralConfig) and cfg.sliding_window == WINDOW
    assert relative_error(jaxscale_logits(model, cfg), transformers_logits(hf_folder)) < 1e-5


def test_the_comparison_sees_the_window(hf_folder):
    """The same weights attending to every earlier token, or to a window one token wider,
    miss transformers' logits: the test above can fail on the window."""
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    want = transformers_logits(hf_folder)
    for window in (0, WINDOW + 1):
        other = dataclasses.replace(cfg, sliding_window=window)
        unwindowed = nnx.merge(nnx.graphdef(abstract_model(other)), params)
        assert relative_error(jaxscale_logits(unwindowed, cfg), want) > 1e-3


def test_decoding_with_the_kv_cache_gives_transformers_logits(hf_folder):
    """A prefill of 3 windows, then a token at a time: each query's cache holds every earlier
    position, and the window hides all but its last WINDOW."""
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    decode, logits = jitted(model, "decode"), jitted(model, "logits")
    cache, got = model.init_cache(2, TOKENS.shape[1]), []
    for begin, end in [(0, 3 * WINDOW)] + [(i, i + 1) for i in range(3 * WINDOW, 40)]:
        features, cache = decode(jnp.asarray(TOKENS[:, begin:end]), cache, begin)
        got.append(np.asarray(logits(features))[..., :VOCAB])
    assert relative_error(np.concatenate(got, axis=1), transformers_logits(hf_folder)) < 1e-5


def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    """A jaxscale Mistral (random) exported in float32 loads as MistralForCausalLM with no
    missing or unexpected weights and gives jaxscale's logits; its config.json carries the
    window, and it imports back bit for bit."""
    config = default_config()
    config.model.update(name="mistral", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                        n_kv_heads=2, head_dim=8, mlp_dim=64, max_seq_len=4096,
                        sliding_window=WINDOW)
    model, cfg, out, exported = exported_like_a_trained_model(config, tmp_path / "out")
    assert (exported["architectures"], exported["model_type"], exported["sliding_window"]) == (
        ["MistralForCausalLM"], "mistral", WINDOW)
    _, info = transformers.MistralForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert relative_error(transformers_logits(out), jaxscale_logits(model, cfg)) < 1e-5
    assert_imports_back_bit_for_bit(model, cfg, out)


def test_shipped_7b_config_is_the_published_model(tmp_path):
    """configs/mistral_7b.py exports the published config.json's shapes and settings, the
    published config.json imports (configs/hf.py's way) as its model section, and it has as
    many parameters as transformers' MistralForCausalLM of that config (built without memory)."""
    spec = assert_shipped_config_is_published(
        "mistral_7b", PUBLISHED_7B, transformers.MistralForCausalLM, transformers.MistralConfig,
        tmp_path)
    assert round(spec.num_params / 1e9, 2) == 7.24
