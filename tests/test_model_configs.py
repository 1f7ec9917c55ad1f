"""Shipped large configs have the published parameter counts (from shapes, nothing allocated)."""

import os

import pytest

from jaxscale.cli import load_config_file
from jaxscale.train_state import model_spec

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
