"""The step settings each device chooses (jaxscale/training/step_settings.py): what it tries and
in which order, what a config's own keys keep, a plain run falling back to the next choice when
a step does not fit, the planner's candidates, and the steps of every choice training alike."""

import jax
import numpy as np
import pytest

from jaxscale.checks import checked_mesh
from jaxscale.config import check_schema
from jaxscale.errors import ConfigError
from jaxscale.plan.planner import make_plan
from jaxscale.plan.search import candidates
from jaxscale.plan.targets import parse_target
from jaxscale.training import step_settings
from jaxscale.training.program import TrainProgram
from jaxscale.training.step_settings import FAST, LEAN, StepSettings, choices
from tests.helpers import random_batch, small_config


def test_gpus_try_the_fast_settings_then_the_lean_ones_and_tpus_and_cpus_the_lean_ones():
    config = small_config()
    assert choices(config, "gpu") == [FAST, LEAN]
    assert choices(config, "tpu") == [LEAN] and choices(config, "cpu") == [LEAN]
    assert FAST == StepSettings(scan_unroll=0, loss_chunk_len=0, loss_vocab_tile=0)
    assert LEAN == StepSettings(scan_unroll=1, loss_chunk_len=1024, loss_vocab_tile=16384)


def test_the_keys_a_config_sets_are_kept_in_every_choice():
    config = small_config()
    config.model.scan_unroll = 4
    assert choices(config, "gpu") == [StepSettings(4, 0, 0), StepSettings(4, 1024, 16384)]
    assert choices(config, "tpu") == [StepSettings(4, 1024, 16384)]
    config.model.update(loss_chunk_len=512, loss_vocab_tile=0)  # all set: one choice, anywhere
    assert choices(config, "gpu") == choices(config, "tpu") == [StepSettings(4, 512, 0)]


@pytest.mark.parametrize("key", ["scan_unroll", "loss_chunk_len", "loss_vocab_tile"])
def test_a_negative_setting_other_than_auto_is_one_line_naming_the_key(key):
    config = small_config()
    config.model[key] = -2
    with pytest.raises(ConfigError, match=rf"^model\.{key}=-2 must be >= 0 .*-1 \(chosen for "
                                          r"the device\)$"):
        check_schema(config)


def _program(config, **mesh):
    config.mesh.update(mesh)
    devices = jax.devices()[:int(np.prod(list(mesh.values())))]
    return TrainProgram(config, checked_mesh(config, devices))


def test_a_plain_run_takes_the_first_choice_that_fits_and_the_leanest_when_none_does(
        monkeypatch):
    """With a CPU made to prefer the fast settings: no capacity known or room for the fast
    step, the fast program; room for none, the last (lean) one, whose config says so."""
    monkeypatch.setitem(step_settings.PREFERENCES, "cpu", (FAST, LEAN))
    program = _program(small_config(), data=1)
    assert program.settings == FAST and program.config.model.scan_unroll == 0
    fast, _, fast_memory = program.compile_fitting_step(None)
    assert fast is program
    roomy, _, _ = program.compile_fitting_step(fast_memory.total)
    assert roomy.settings == FAST
    lean, compiled, memory = program.compile_fitting_step(1)
    assert lean.settings == LEAN and lean.config.model.loss_chunk_len == 1024
    assert lean.requested is program.requested and " while(" in compiled.as_text()
    assert memory.total > 1  # refused by the caller's check, not here


@pytest.mark.slow  # two steps trained on a sharded mesh (about 10 s)
def test_the_fast_and_lean_steps_train_alike_on_a_sharded_mesh():
    """One train step from the same init, every layer unrolled with whole logits against a
    layer loop with the loss in slices of 4 positions and vocabulary tiles of 128: the same loss
    and parameters, to float32 rounding."""
    config = small_config()
    batch = random_batch(config)
    results = []
    for settings in (FAST, StepSettings(scan_unroll=1, loss_chunk_len=4, loss_vocab_tile=128)):
        program = _program(settings.apply(config), fsdp=2, tensor=2)
        assert program.settings == settings
        state = program.init_state(config.train.seed)
        placed = jax.device_put(batch, program.batch_sharding)
        state, metrics = program.train_step(state, placed)
        results.append((float(metrics["loss"]), jax.device_get(state.params)))
    (loss_fast, params_fast), (loss_lean, params_lean) = results
    np.testing.assert_allclose(loss_fast, loss_lean, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 params_fast, params_lean)


@pytest.mark.usefixtures("no_gpu_compiler")
def test_the_planner_searches_every_choice_and_prefers_the_fast_one_on_a_gpu():
    """On GPUs each layout comes with both settings, the fast one first in preference; the
    estimates alone (no GPU compiler) choose it on the tie, and its flags say so. A TPU slice's
    candidates carry the lean settings only, so its plan is what it was."""
    config = small_config()
    gpu = candidates(config, 8, 1, "gpu")
    assert {(c.step, c.step_preference) for c in gpu} == {(FAST, 0), (LEAN, 1)}
    assert len(gpu) == 2 * len(candidates(config, 8, 1, "tpu"))
    assert {c.step for c in candidates(config, 8, 1, "tpu")} == {LEAN}
    plan = make_plan(config, parse_target("h100:8"), top=2)
    assert plan.chosen.candidate.step == FAST
    assert "--config.model.scan_unroll=0" in plan.chosen.candidate.overrides()
    assert "layers unrolled, whole logits" in plan.chosen.candidate.summary()


def test_with_every_layer_unrolled_remat_still_recomputes():
    """A remat policy's recomputation must not be merged back into the forward pass it repeats:
    unrolled, save_dots holds less than no remat (before the barrier the two compiled to the same
    program: llama_1b for an H100 took 33.3 GiB under both, now 29.8 under save_dots)."""
    temporaries = {}
    for remat in ("none", "save_dots"):
        config = small_config()
        config.model.update(remat=remat, n_layers=4)
        config.train.update(batch_size=8, seq_len=128)
        _, memory = _program(FAST.apply(config), data=1).compile_train_step()
        temporaries[remat] = memory.temporaries
    assert temporaries["save_dots"] < temporaries["none"]
