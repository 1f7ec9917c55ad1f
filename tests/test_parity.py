"""Parallelism parity: the same seed and batch give the same losses and parameters on any mesh,
and k microbatches of b sequences give the update of one batch of k*b; for each model family
(`FAMILY_CASES`: Mistral, Gemma 3, Mixtral and Qwen3-MoE on fsdp x tensor and on pipeline
stages or an expert axis; Qwen3 below: on the meshes, in pipeline stages and context shards,
with LoRA and fp8)."""

import jax
import numpy as np
import pytest

from jaxscale.parallel.sharding import with_rules
from jaxscale.trainer import Trainer
from jaxscale.training.step import Objective, Weights
from tests.helpers import loss_and_gradients_on_mesh, random_batch, small_config

STEPS = 3


def train(config, tmp_path, devices=None, batches=None):
    # One batch repeated, so that the loss must fall if the steps really train.
    batches = batches or [random_batch(config)] * STEPS
    trainer = Trainer(config, str(tmp_path), devices=devices)
    state = trainer.program.init_state(config.train.seed)
    first_batch = jax.device_put(batches[0], trainer.program.batch_sharding)
    grads = jax.device_get(initial_gradients(trainer, state.params, first_batch))
    losses, grad_norms = [], []
    for i in range(STEPS):
        batch = jax.device_put(batches[i], trainer.program.batch_sharding)
        state, metrics = trainer.program.train_step(state, batch)
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(grad_norms), jax.device_get(state.params), grads


def initial_gradients(trainer, params, batch):
    """Gradient of the mean token loss, computed under the trainer's mesh and rules."""
    program = trainer.program

    def mean_loss(p):
        total, tokens, _ = Objective(program.model.graphdef).summed_loss(Weights(p), batch)
        return total / tokens
    return jax.jit(with_rules(jax.grad(mean_loss), program.mesh, program.rules))(params)


def assert_same_training(run, reference, params_atol=5e-5):
    losses, grad_norms, params, grads = run
    ref_losses, ref_grad_norms, ref_params, ref_grads = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(grad_norms, ref_grad_norms, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 grads, ref_grads)
    # Adam divides by sqrt(v), which turns float-reassociation noise on near-zero gradients into
    # differences of a fraction of one step (lr = 3e-3); 5e-5 is under 2% of a step.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=params_atol),
                 params, ref_params)


def qwen3_config(**mesh):
    """`small_config` as a Qwen3 (jaxscale/models/qwen3.py): per-head q/k norms, heads twice
    d_model wide (4 x 32 over 64), theta 1e6, tied embeddings."""
    config = small_config(**mesh)
    config.model.update(name="qwen3", head_dim=32, rope_theta=1e6, norm_eps=1e-6,
                        tie_embeddings=True)
    return config


def mistral_config(**mesh):
    """`small_config` as a Mistral: a sliding window of 8, shorter than the 16-token rows."""
    config = small_config(**mesh)
    config.model.update(name="mistral", sliding_window=8)
    return config


def gemma3_config(**mesh):
    """`small_config` as a Gemma 3: the first layer local (window 8, its own RoPE base), the
    second global, q/k norms, GeGLU, norms after each sub-layer, scaled embeddings."""
    config = small_config(**mesh)
    config.model.update(name="gemma3", sliding_window=8, global_every=2, rope_local_theta=100.0,
                        rope_theta=1e6, query_pre_attn_scalar=12, tie_embeddings=True)
    return config


def mixture(family: str, base=small_config):
    """`base` as the mixture `family`: 4 experts in every layer, top 2, dropless as imported
    from Hugging Face."""
    def config(**mesh):
        c = base(**mesh)
        c.model.name = family
        c.model.moe.update(experts=4, top_k=2, every=1, capacity_factor=0.0)
        return c
    return config


CONFIGS = {"llama": small_config, "qwen3": qwen3_config, "mistral": mistral_config,
           "gemma3": gemma3_config, "mixtral": mixture("mixtral"),
           "qwen3_moe": mixture("qwen3_moe", qwen3_config)}  # a small model of each family
# The parity meshes of the families beyond Llama and Qwen3: fsdp with tensor, then pipeline
# stages for the dense ones and an expert axis for the mixtures (which no pipeline takes yet).
MIXTURES = ("mixtral", "qwen3_moe")
FAMILY_CASES = [(family, mesh) for family in ("mistral", "gemma3", *MIXTURES)
                for mesh in (dict(fsdp=4, tensor=2),
                             dict(expert=4, data=2) if family in MIXTURES
                             else dict(pipeline=2, fsdp=2, tensor=2))]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    """family -> its run on one device (made when first asked for)."""
    runs = {}

    def run(family):
        if family not in runs:
            runs[family] = train(CONFIGS[family](), tmp_path_factory.mktemp(family),
                                 devices=jax.devices()[:1])
        return runs[family]
    return run


@pytest.mark.parametrize("family,mesh", [
    pytest.param("llama", dict(data=8), marks=pytest.mark.slow),
    pytest.param("llama", dict(fsdp=4, tensor=2), marks=pytest.mark.slow),
    ("llama", dict(data=2, fsdp=2, tensor=2)),
    # Qwen3's layers on these meshes without the slow mark: its gradients, below.
    *(pytest.param("qwen3", mesh, marks=pytest.mark.slow)
      for mesh in (dict(data=8), dict(fsdp=4, tensor=2), dict(data=2, fsdp=2, tensor=2))),
    *(pytest.param(family, mesh, marks=pytest.mark.slow) for family, mesh in FAMILY_CASES)])
def test_meshes_match_one_device(mesh, family, single_device, tmp_path):
    run = train(CONFIGS[family](**mesh), tmp_path)
    # A mixture's routers add near-zero gradients (rows of rarely routed tokens, one element of
    # 24576 seen at 6.4e-5 off on fsdp x tensor): 1e-4 is 3% of a step.
    assert_same_training(run, single_device(family), 1e-4 if family in MIXTURES else 5e-5)
    losses = run[0]
    assert losses[-1] < losses[0]  # the steps really trained


@pytest.mark.slow
def test_microbatches_match_one_big_batch(single_device, tmp_path):
    config = small_config(data=2, fsdp=2, tensor=2)
    config.train.microbatches = 2
    assert_same_training(train(config, tmp_path), single_device("llama"))


@pytest.mark.slow
def test_loss_ignores_masked_tokens(tmp_path):
    """Changing targets under a zero loss mask changes nothing."""
    config = small_config()
    batch = random_batch(config)
    altered = {k: v.copy() for k, v in batch.items()}
    altered["targets"][batch["loss_mask"] == 0] = 7
    a = train(config, tmp_path / "a", devices=jax.devices()[:1], batches=[batch] * STEPS)
    b = train(config, tmp_path / "b", devices=jax.devices()[:1], batches=[altered] * STEPS)
    np.testing.assert_array_equal(a[0], b[0])


# -- Qwen3 beyond the meshes above: stages, context shards, LoRA, fp8 ------------------------------

@pytest.fixture(scope="module")
def qwen3_gradients(tmp_path_factory):
    """The mean loss and its gradient on one device."""
    return loss_and_gradients_on_mesh(qwen3_config(), tmp_path_factory.mktemp("qwen3_grads"))


@pytest.mark.parametrize("mesh,schedule", [
    (dict(data=2, fsdp=2, tensor=2), "gpipe"),
    (dict(pipeline=2, tensor=2), "gpipe"),
    pytest.param(dict(pipeline=2, fsdp=2), "1f1b", marks=pytest.mark.slow),
    (dict(context=2, fsdp=2), "gpipe")],
    ids=["data-fsdp-tensor", "pipeline-gpipe", "pipeline-1f1b", "context"])
def test_qwen3_meshes_stages_and_context_shards_give_one_devices_gradients(
        mesh, schedule, qwen3_gradients, tmp_path):
    config = qwen3_config(**mesh)
    config.pipeline.schedule = schedule
    got = loss_and_gradients_on_mesh(config, tmp_path)
    np.testing.assert_allclose(got.loss, qwen3_gradients.loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max())), got.grads, qwen3_gradients.grads)


@pytest.mark.slow
def test_qwen3_lora_trains_in_1f1b_stages_as_on_one_device():
    """The adapters (q and k's among them, before the norms) train in pipeline stages as on one
    device."""
    from tests.test_lora import steps_on

    def lora(**mesh):
        config = qwen3_config(**mesh)
        config.model.lora.update(rank=4, alpha=8.0)
        config.pipeline.schedule = "1f1b"
        return config
    losses, adapters = steps_on(lora(pipeline=2, tensor=2))
    one_losses, one_adapters = steps_on(lora())
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 adapters, one_adapters)


@pytest.mark.slow
def test_qwen3_trains_in_fp8_close_to_bfloat16(tmp_path):
    """fp8 matmuls (q, k, v, o and the feed-forward's) with the q/k norms after them: every site
    has its meta, and the losses stay within fp8's rounding of bfloat16's as they fall."""
    from tests.test_fp8 import train_steps

    def fp8(matmul):
        config = qwen3_config()
        config.precision.update(compute_dtype="bfloat16", matmul=matmul, fp8_amax_history=4)
        return config
    state, losses, _ = train_steps(fp8("fp8"), workdir=tmp_path / "fp8")
    _, bf16_losses, _ = train_steps(fp8("bfloat16"), workdir=tmp_path / "bf16")
    assert set(state.fp8["blocks"]["attn"]) == {"q_fp8", "k_fp8", "v_fp8", "o_fp8"}
    np.testing.assert_allclose(losses, bf16_losses, rtol=0.02)
    assert losses[-1] < losses[0]
