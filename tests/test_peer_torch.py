"""The PyTorch peer of benchmarks/peer_torch.py at tiny shapes on the CPU: the model jaxscale's
config describes, the optimizer and schedule it trains with, remat mapped to checkpointing, and
the log windows it reports. (On a GPU, benchmarks/accelerator.sh --peer runs it at full size.)"""

import math

import numpy as np
import pytest

from jaxscale.models.spec import model_spec
from jaxscale.training.optim import learning_rate_schedule
from tests.helpers import benchmark_module, small_config

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _config(remat="none"):
    config = small_config()
    config.model.update(remat=remat, tie_embeddings=True)
    config.train.update(steps=6, log_every=3, batch_size=2, seq_len=16)
    config.optim.warmup_steps = 2
    return config


def test_the_peer_is_the_configs_model_and_optimizer():
    peer, config = benchmark_module("peer_torch"), _config()
    model = peer.build_model(config, "cpu")
    # The same parameters jaxscale counts (the padded vocabulary's rows, tied head).
    assert sum(p.numel() for p in model.parameters()) == model_spec(config).num_params
    assert model.config.tie_word_embeddings and not model.is_gradient_checkpointing
    optimizer, rates = peer.build_optimizer(config, model, "cpu")
    decayed, plain = optimizer.param_groups
    assert decayed["weight_decay"] == config.optim.weight_decay and plain["weight_decay"] == 0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1
                                                               for p in plain["params"])
    assert optimizer.defaults["betas"] == (config.optim.b1, config.optim.b2)
    schedule = learning_rate_schedule(config.optim, config.train.steps)
    np.testing.assert_allclose(rates, [schedule(i) for i in range(config.train.steps)],
                               rtol=1e-6)
    assert rates[0] == 0 and rates.max() == pytest.approx(config.optim.lr)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_maps_to_activation_checkpointing(remat):
    model = benchmark_module("peer_torch").build_model(_config(remat), "cpu")
    assert model.is_gradient_checkpointing


def test_the_peer_trains_and_reports_its_last_window(capsys):
    """Eager at tiny shapes: two windows of three steps, the loss near log(vocabulary) at the
    start (random init) and falling on repeated random tokens is not asked; the figures are the
    last window's."""
    peer, config = benchmark_module("peer_torch"), _config("save_dots")
    result = peer.train(config, "cpu", compiled=False)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 2 and result["step"] == 6
    assert abs(result["loss"] - math.log(config.model.vocab_size)) < 1.0
    assert result["tokens_per_sec"] == pytest.approx(2 * 16 / result["step_time"])
    assert result["mfu"] is None and result["params"] == model_spec(config).num_params
