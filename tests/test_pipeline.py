"""Pipeline parallelism (issue 10): every schedule gives the loss and gradients of the plain stacked
model, on its own and combined with the other mesh axes; each device holds only its stage's
layers; a run restores across pipeline degrees and continues with the same losses.

Every batch here is packed (two documents and padding per row: `random_batch`), so the segment ids
and positions go through the schedules with their microbatches.
"""

import jax
import numpy as np
import pytest

from jaxscale.models.llama import LlamaConfig
from jaxscale.models.spec import model_config
from jaxscale.parallel.pipeline import Pipeline
from jaxscale.plan.compiled import compile_train_step
from jaxscale.trainer import Trainer
from jaxscale.training.step import Objective, Weights
from tests.helpers import (
    loss_and_gradients_on_mesh,
    mesh_devices,
    mesh_trainer,
    random_batch,
    resumable_cli_losses,
    small_config,
)
from tests.test_parity import assert_same_training, train


def pipeline_config(schedule="gpipe", repeats=1, microbatches=0, layers=8, remat="none",
                    **mesh):
    config = small_config(**mesh)
    config.model.update(n_layers=layers, remat=remat)
    config.train.batch_size = 16
    config.pipeline.update(schedule=schedule, repeats=repeats, microbatches=microbatches)
    return config


def plain_loss_and_grads(config, workdir):
    """The mean loss and its gradient of `config`'s model with no pipeline, on one device,
    differentiated by jax.grad."""
    trainer = Trainer(config, str(workdir), devices=jax.devices()[:1])
    params = trainer.program.init_state(config.train.seed).params
    batch = random_batch(config)

    def mean_loss(p):
        total, tokens, _ = Objective(trainer.program.model.graphdef).summed_loss(Weights(p),
                                                                                  batch)
        return total / tokens
    return jax.device_get(jax.jit(jax.value_and_grad(mean_loss))(params))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plain 8-layer model on one device."""
    return plain_loss_and_grads(pipeline_config(), tmp_path_factory.mktemp("ref"))


def assert_same_loss_and_gradients(loss, grads, reference):
    ref_loss, ref_grads = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    # atol: float32 sums in another order, relative to the gradient's largest entry (a gradient
    # of 1.8e-4 once differed by 1.2e-8 where the largest was 2.4e-2).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max())), grads, ref_grads)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-3


@pytest.mark.parametrize("schedule,repeats,remat,mesh", [
    # Without the slow ones, each schedule, repeat count, remat policy and other axis still runs.
    ("gpipe", 1, "none", dict(pipeline=2)),
    pytest.param("gpipe", 1, "full", dict(pipeline=4), marks=pytest.mark.slow),
    pytest.param("gpipe", 2, "none", dict(pipeline=2), marks=pytest.mark.slow),
    ("gpipe", 2, "save_dots", dict(pipeline=4)),
    pytest.param("1f1b", 1, "none", dict(pipeline=2), marks=pytest.mark.slow),
    ("1f1b", 1, "full", dict(pipeline=4)),
    pytest.param("gpipe", 2, "none", dict(pipeline=2, fsdp=2), marks=pytest.mark.slow),
    ("1f1b", 1, "save_dots", dict(pipeline=2, fsdp=2)),
    ("gpipe", 1, "none", dict(pipeline=2, tensor=2)),
    pytest.param("1f1b", 1, "none", dict(pipeline=2, tensor=2), marks=pytest.mark.slow),
    pytest.param("gpipe", 1, "none", dict(pipeline=4, data=2), marks=pytest.mark.slow),
    ("1f1b", 1, "none", dict(pipeline=2, data=2, fsdp=2)),
])
def test_schedules_give_the_plain_models_loss_and_gradients(schedule, repeats, remat, mesh,
                                                            reference, tmp_path):
    """Against jax.grad of the plain model (remat none) on one device; remat recomputes the same
    float32 values, so every policy must match too."""
    config = pipeline_config(schedule, repeats, remat=remat, **mesh)
    loss, grads, _ = loss_and_gradients_on_mesh(config, tmp_path)
    assert_same_loss_and_gradients(loss, grads, reference)


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_feed_forwards_in_chunks_give_the_plain_models_loss_and_gradients_on_stages(
        schedule, reference, tmp_path, monkeypatch):
    """Under remat full with the feed-forward in 2 chunks (`MLP.in_chunks`, 64 hidden units
    each here), vmapped over the stages of a pipeline with fsdp."""
    monkeypatch.setattr(LlamaConfig, "mlp_chunks", property(
        lambda cfg: 2 if cfg.remat == "full" else 1))
    config = pipeline_config(schedule, remat="full", pipeline=2, fsdp=2)
    assert model_config(config).mlp_chunks == 2
    loss, grads, _ = loss_and_gradients_on_mesh(config, tmp_path)
    assert_same_loss_and_gradients(loss, grads, reference)


def test_layers_sharded_over_fsdp_without_stages_run_no_pipeline(reference, tmp_path):
    """sharding.rules.layers=('fsdp',) with mesh.pipeline=1 splits the stacked layers over fsdp
    and runs them in one stage (the step takes its pipeline from the program, which reads
    mesh.pipeline): the plain model's loss and gradients, and no stage-to-stage shift in the
    program. (When the step counted stages from the axes the layers rule maps to, it built two
    over fsdp and failed to trace.)"""
    config = pipeline_config(fsdp=2)
    config.sharding.rules.layers = ("fsdp",)
    loss, grads, hlo = loss_and_gradients_on_mesh(config, tmp_path)
    assert_same_loss_and_gradients(loss, grads, reference)
    assert "collective-permute" not in hlo


@pytest.mark.slow  # a 1F1B step against the plain model (about 11 s)
def test_1f1b_with_microbatches_not_a_multiple_of_the_stages(tmp_path):
    """M=4 on 3 stages: the microbatches' inputs are spread over the stages two slots each, the
    last two empty; the loss and gradients are still the plain model's."""
    config = pipeline_config("1f1b", microbatches=4, layers=6, pipeline=3)
    loss, grads, _ = loss_and_gradients_on_mesh(config, tmp_path / "pp")
    assert_same_loss_and_gradients(
        loss, grads, plain_loss_and_grads(pipeline_config(layers=6), tmp_path / "plain"))


@pytest.mark.slow
def test_1f1b_compiles_to_under_half_of_gpipes_temporaries():
    """Both at remat full, M=16 on 4 stages x data 2, the loss computed 16 positions at a time on
    both (GPipe's head runs on the whole batch after its loop, 1F1B's on one microbatch per tick:
    chunking keeps the logits from deciding). 1F1B keeps 2S - 1 = 7 stage inputs in flight where
    GPipe keeps the layer inputs of all its M + S - 1 = 19 ticks: 0.37 of them, or less with more
    than one layer per stage. With what both hold alike (the weights' gradients, one layer's
    backward, the optimizer's update), the compiled step must still need under half GPipe's
    temporary memory per device; it needed 0.63 while every stage held all M microbatches'
    inputs and input gradients, and the stage's weight gradients twice."""
    temporaries = {}
    for schedule in ("gpipe", "1f1b"):
        config = pipeline_config(schedule, microbatches=16, remat="full", pipeline=4, data=2)
        config.train.update(batch_size=32, seq_len=64)
        config.model.loss_chunk_len = 16
        temporaries[schedule] = compile_train_step(config, mesh_devices(config))[1].temporaries
    assert temporaries["1f1b"] < 0.5 * temporaries["gpipe"], temporaries


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.slow
def test_pipelined_training_with_accumulation_matches_one_device(schedule, tmp_path):
    """Three optimizer steps with train.microbatches=2 (gradient accumulation around the
    pipeline) on pipeline=2 x data=2 x tensor=2 equal three steps on one device."""
    config = pipeline_config(schedule, layers=2, pipeline=2, data=2, tensor=2)
    config.train.microbatches = 2
    run = train(config, tmp_path / "pp")
    single = pipeline_config(layers=2)
    assert_same_training(run, train(single, tmp_path / "one", devices=jax.devices()[:1]))


@pytest.mark.parametrize("schedule,dtype", [("gpipe", "bfloat16"), ("1f1b", "float16")])
@pytest.mark.slow
def test_low_precision_pipelines_train_like_the_plain_model(schedule, dtype, tmp_path):
    """bfloat16, and float16 with its dynamic loss scale (which 1F1B applies at the start of each
    microbatch's backward), give the plain model's first losses, to their precision."""
    config = pipeline_config(schedule, layers=2, pipeline=2)
    config.precision.compute_dtype = dtype
    plain = pipeline_config(layers=2)
    plain.precision.compute_dtype = dtype
    losses = train(config, tmp_path / f"pp-{dtype}", devices=mesh_devices(config))[0]
    reference = train(plain, tmp_path / f"one-{dtype}", devices=jax.devices()[:1])[0]
    np.testing.assert_allclose(losses, reference, rtol=2e-3)
    assert losses[-1] < losses[0]


def test_each_device_holds_only_its_stages_layers(tmp_path):
    config = pipeline_config(pipeline=4, data=2)
    trainer = mesh_trainer(config, tmp_path)
    state = trainer.program.init_state(config.train.seed)
    layers = config.model.n_layers
    for leaf in jax.tree.leaves(state.params["blocks"]) + jax.tree.leaves(
            state.opt_state):
        if leaf.ndim == 0 or leaf.shape[0] != layers:
            continue
        for shard in leaf.addressable_shards:
            layer_slice = shard.index[0]
            assert layer_slice.stop - layer_slice.start == layers // 4
            where = np.argwhere(trainer.program.mesh.devices == shard.device)[0]
            device_stage = where[trainer.program.mesh.axis_names.index("pipeline")]
            assert layer_slice.start == device_stage * layers // 4
    # Parameter bytes per device: a quarter of the layer stack plus everything outside it.
    def bytes_on(device, tree):
        return sum(s.data.nbytes for leaf in jax.tree.leaves(tree)
                   for s in leaf.addressable_shards if s.device == device)
    device = trainer.program.mesh.devices.flat[0]
    stack = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params["blocks"]))
    outside = sum(leaf.nbytes for leaf in jax.tree.leaves(state.params)) - stack
    assert bytes_on(device, state.params) == stack // 4 + outside


def test_bubble_fractions():
    assert Pipeline(4, 8).bubble_fraction() == pytest.approx(3 / 11)
    assert Pipeline(4, 8, repeats=2).bubble_fraction() == pytest.approx(3 / 19)
    assert Pipeline(4, 16, schedule="1f1b").bubble_fraction() == pytest.approx(6 / 22)
    assert Pipeline(2).num_microbatches == 4


def run_cli(workdir, steps, pipeline, schedule="gpipe"):
    return resumable_cli_losses(workdir, steps, **{"mesh.pipeline": pipeline,
                                                   "pipeline.schedule": schedule})


@pytest.mark.slow
def test_cli_trains_tiny_on_pipelines_and_restores_across_degrees(tmp_path):
    """configs/tiny.py through the CLI: pipeline=4 (gpipe) for steps 1-2, restored with no
    pipeline for steps 3-4; pipeline=1 for steps 1-2, restored on pipeline=2 (1f1b) for 3-4. Every
    step's loss equals the plain run's."""
    plain, _ = run_cli(tmp_path / "plain", 4, 1)
    four, log = run_cli(tmp_path / "a", 2, 4)
    assert "pipeline: 4 stages" in log
    to_one, _ = run_cli(tmp_path / "a", 4, 1)
    one, _ = run_cli(tmp_path / "b", 2, 1)
    to_two, _ = run_cli(tmp_path / "b", 4, 2, "1f1b")
    joined_a = {**four, **to_one}
    joined_b = {**one, **to_two}
    assert sorted(joined_a) == sorted(joined_b) == sorted(plain) == [1, 2, 3, 4]
    for joined in (joined_a, joined_b):
        np.testing.assert_allclose([joined[s] for s in range(1, 5)],
                                   [plain[s] for s in range(1, 5)], rtol=1e-4)
