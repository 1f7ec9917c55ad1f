"""Shipped large configs have the published parameter counts (from shapes, nothing allocated);
the model's FLOPs per token match a hand count."""

import os

import pytest

from jaxscale.cli import load_config_file
from jaxscale.models.llama import LlamaConfig
from jaxscale.models.spec import abstract_model, count_params, model_spec

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.mark.parametrize("name,published", [
    ("llama_1b", 1_235_814_400),  # Llama 3.2 1B, tied embeddings
    ("llama3_8b", 8_030_261_248),  # Llama 3 8B
])
def test_parameter_count_matches_published(name, published):
    assert model_spec(load_config_file(os.path.join(CONFIGS, f"{name}.py"))).num_params == published


def test_tiny_is_between_one_and_five_million():
    count = model_spec(load_config_file(os.path.join(CONFIGS, "tiny.py"))).num_params
    assert 1_000_000 <= count <= 5_000_000


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_flops_per_token_match_a_count_of_the_matmuls(tie_embeddings):
    cfg = LlamaConfig(vocab_size=259, vocab_multiple=128, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2, head_dim=16, mlp_dim=128, tie_embeddings=tie_embeddings)
    seq_len, d, layers = 32, cfg.d_model, cfg.n_layers
    # Forward, per token: 2 FLOPs per weight of each matmul...
    per_layer = d * 4 * 16 + 2 * d * 2 * 16 + 4 * 16 * d + 3 * d * 128  # q, k+v, o, SwiGLU
    head = 384 * d  # the padded vocabulary; the input embedding is a lookup unless tied
    weights = layers * per_layer + head
    # ... plus per layer q.k over seq_len keys and the weighted sum of seq_len values.
    attention = layers * 4 * 2 * (2 * seq_len * 16)
    expected = 3 * (2 * weights + attention)  # the backward pass costs twice the forward
    num_params = count_params(abstract_model(cfg))
    norms = (2 * layers + 1) * d  # not matmuls, but in N as PaLM counts it
    assert cfg.flops_per_token(num_params, seq_len) == expected + 6 * norms
