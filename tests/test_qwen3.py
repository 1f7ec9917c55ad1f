"""Qwen3 through the model door: Hugging Face import and export against transformers'
Qwen3ForCausalLM (random weights built here, nothing downloaded), and the shipped 0.6B config
against the published one.

Needs torch and transformers (the `test` extra installs torch's CPU build on Python 3.11 only;
the Python 3.12 CI venv skips this file). Training on meshes, with LoRA and in pipeline stages:
tests/test_parity.py.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale import hf
from jaxscale.cli import load_config_file
from jaxscale.config import default_config
from jaxscale.errors import JaxscaleError
from jaxscale.hf.config import hf_config, model_section
from jaxscale.models.qwen3 import Qwen3Config
from jaxscale.models.spec import abstract_model, model_spec
from tests.helpers import (
    assert_imports_back_bit_for_bit,
    exported_like_a_trained_model,
    float64_rotation,
    relative_error,
    saved_with_norms_off_one,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THETA = 1_000_000.0
VOCAB = 300
# Two rows: positions 0.. and, near Qwen3's 40960, 40000.. (where an angle formed in float32 is
# off by ~2e-3 rad).
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 16)).astype(np.int32)
POSITIONS = np.stack([np.arange(16), 40_000 + np.arange(16)]).astype(np.int32)

# Qwen/Qwen3-0.6B's config.json (its shapes and settings; ids and dtype left out).
PUBLISHED_0_6B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
    head_dim=128, hidden_act="silu", hidden_size=1024, intermediate_size=3072,
    max_position_embeddings=40960, num_attention_heads=16, num_hidden_layers=28,
    num_key_value_heads=8, rms_norm_eps=1e-6, rope_scaling=None, rope_theta=1000000,
    tie_word_embeddings=True, use_sliding_window=False, vocab_size=151936)


def small_hf_config(tied: bool) -> transformers.Qwen3Config:
    """2 layers, 4 query and 2 key/value heads of head_dim 16: the heads (64 wide) are twice
    d_model (32), as in Qwen3-0.6B."""
    return transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=THETA),
        tie_word_embeddings=tied,
        # Weights large enough that attention is far from uniform: a wrong position or a norm in
        # the wrong place moves the logits well past the tolerance.
        initializer_range=0.3)


def transformers_logits(folder: str) -> np.ndarray:
    """The folder's logits for TOKENS at POSITIONS, computed by transformers in float64."""
    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float64)
    model.config._attn_implementation = "eager"
    # jaxscale's rotation is checked against float64 on its own (tests/test_hf.py): this
    # compares all the rest.
    float64_rotation(model.model.rotary_emb, model.config.head_dim, THETA)
    with torch.no_grad():
        return model(input_ids=torch.tensor(TOKENS, dtype=torch.long),
                     position_ids=torch.tensor(POSITIONS, dtype=torch.long)).logits.numpy()


def jaxscale_logits(model, cfg) -> np.ndarray:
    out = model(jnp.asarray(TOKENS), jnp.asarray(POSITIONS))
    return np.asarray(out)[..., :cfg.vocab_size]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_folder(request, tmp_path_factory) -> str:
    """A random float32 Qwen3ForCausalLM saved by transformers, its norms away from 1 so that a
    swapped or missing norm (q_norm, k_norm included) shows."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(small_hf_config(tied=request.param))
    return saved_with_norms_off_one(model, tmp_path_factory.mktemp("qwen3") / "model")


def test_imported_logits_equal_transformers(hf_folder):
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    assert isinstance(cfg, Qwen3Config) and cfg.qk_norm and cfg.rope_theta == THETA
    assert (cfg.head_dim, cfg.n_heads * cfg.head_dim, cfg.d_model) == (16, 64, 32)
    assert relative_error(jaxscale_logits(model, cfg), transformers_logits(hf_folder)) < 1e-5


def test_the_comparison_sees_the_qk_norms(hf_folder):
    """The same weights without the q/k norms miss transformers' logits by far: the test above
    can fail on them."""
    model, cfg = hf.load_model(hf_folder, compute_dtype="float32")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name in ("q_norm", "k_norm"):
        del params["blocks"]["attn"][name]
    plain = nnx.merge(nnx.graphdef(abstract_model(dataclasses.replace(cfg, qk_norm=False))),
                      params)
    assert relative_error(jaxscale_logits(plain, cfg), transformers_logits(hf_folder)) > 1e-2


def test_export_loads_in_transformers_with_equal_logits(tmp_path):
    """A jaxscale Qwen3 (untied, random) exported in float32 loads as Qwen3ForCausalLM with no
    missing or unexpected weights and gives jaxscale's logits; its config.json is a Qwen3's, and
    it imports back bit for bit."""
    config = default_config()
    config.model.update(name="qwen3", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4,
                        n_kv_heads=2, head_dim=16, mlp_dim=64, max_seq_len=40960,
                        rope_theta=THETA, norm_eps=1e-6)
    model, cfg, out, exported = exported_like_a_trained_model(config, tmp_path / "out")
    assert (exported["architectures"], exported["model_type"], exported["head_dim"]) == (
        ["Qwen3ForCausalLM"], "qwen3", 16)
    # As docs/huggingface.md loads an export: LlamaForCausalLM would drop q_norm and k_norm.
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out,
                                                                     output_loading_info=True)
    assert isinstance(loaded, transformers.Qwen3ForCausalLM) and not any(info.values()), info
    assert relative_error(transformers_logits(out), jaxscale_logits(model, cfg)) < 1e-5
    assert_imports_back_bit_for_bit(model, cfg, out)


def test_shipped_0_6b_config_is_the_published_model():
    """configs/qwen3_0_6b.py exports the published config.json's shapes and settings, and has as
    many parameters as transformers' Qwen3ForCausalLM of that config (built without memory):
    0.6B, 0.44B of them outside the embedding, as Qwen's model card says."""
    config = load_config_file(os.path.join(REPO, "configs", "qwen3_0_6b.py"))
    spec = model_spec(config)
    exported = hf_config(spec.config, "bfloat16")
    assert {k: exported[k] for k in PUBLISHED_0_6B} == PUBLISHED_0_6B
    with torch.device("meta"):
        reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**PUBLISHED_0_6B))
    assert spec.num_params == reference.num_parameters()
    embedding = spec.config.vocab_size * spec.config.d_model
    assert (round(spec.num_params / 1e9, 1), round((spec.num_params - embedding) / 1e9, 2)) == (
        0.6, 0.44)


def test_a_folder_with_sliding_window_attention_is_refused(tmp_path, hf_folder):
    """jaxscale's Qwen3 has full attention in every layer."""
    folder = tmp_path / "model"
    folder.mkdir()
    for name in os.listdir(hf_folder):
        os.symlink(os.path.join(hf_folder, name), folder / name)
    os.remove(folder / "config.json")
    settings = json.loads(open(os.path.join(hf_folder, "config.json"), encoding="utf-8").read())
    (folder / "config.json").write_text(json.dumps({**settings, "use_sliding_window": True}))
    with pytest.raises(JaxscaleError, match="use_sliding_window=True"):
        model_section(str(folder))
