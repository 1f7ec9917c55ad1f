"""Checks that need an NVIDIA GPU (marked `gpu`): cuDNN attention against XLA's, and the train
step's losses on the GPU against the CPU's.

    benchmarks/accelerator.sh --tests

runs `python -m pytest -q -m gpu tests/test_gpu.py` with JAX_PLATFORMS=cuda,cpu, so the GPU is
JAX's default backend and the CPU backend exists beside it. Anywhere else (tests/conftest.py sets
JAX_PLATFORMS=cpu unless the environment says otherwise) every test here is collected and skipped.

- cuDNN's fused attention (jaxscale/parallel/attention.py), in each form the code has: causal
  rows without segments, packed rows with the document mask as a bias (`max_segments` 0), and
  packed rows in cuDNN's packed layout (segment offsets; Hopper or newer). Each is checked against
  the XLA path on the same bfloat16 inputs: a loss of the output, and its gradients with respect
  to q, k and v. The program must call cuDNN in that form, so a silent fallback to XLA (which
  would agree with itself) fails.
- configs/tiny.py trained a few steps through `jaxscale.Trainer` on the GPU (cuDNN attention)
  and on the CPU (XLA attention), same data and seed: the per-step losses agree.

Tolerances are bfloat16's (8 significant bits: one rounding is off by up to 2^-8 ~ 4e-3
relative), sized from measurements in `assert_close` and `test_train_losses_on_gpu_match_cpu`.
"""

import json
import os
import re
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxscale
from jaxscale.parallel.attention import attend, packed_layout_bound

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.gpu


@pytest.fixture
def gpu():
    """The GPU JAX computes on by default; skips the test where there is none. Looked up when a
    test runs, not at import, so that collecting the suite starts no JAX backend."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        pytest.skip(f"needs an NVIDIA GPU as JAX's default backend (here: {device.platform}); "
                    "run benchmarks/accelerator.sh --tests on a GPU host")
    return device


# --- (a) cuDNN attention against XLA's ---------------------------------------------------------

# form -> (rows packed with segment ids, max_segments); jaxscale/parallel/attention.py's `attend`
# picks the cuDNN call from these, and the custom call names it in the compiled program.
FORMS = {"causal": (False, 0), "document mask": (True, 0), "packed layout": (True, 4)}
CUDNN_CALL = {"causal": "__cudnn$fmhaSoftmax", "document mask": "__cudnn$fmhaScaleBiasSoftmax",
              "packed layout": "__cudnn$fmhaSoftmax"}


def attention_inputs(head_dim, batch=2, length=256, heads=4, kv_heads=2):
    """bfloat16 q [batch, length, heads, head_dim], k and v (grouped-query: 2 heads a KV head, as
    the models have), and segment ids: row 0 two documents (100 and 150 tokens) then 6 tokens of
    padding (id 0): 3 runs, within the packed layout's 4; row 1 a single document."""
    rng = np.random.default_rng(head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal((batch, length, n, head_dim)), jnp.bfloat16)
               for n in (heads, kv_heads, kv_heads))
    segments = np.ones((batch, length), np.int32)
    segments[0, 100:], segments[0, 250:] = 2, 0
    return q, k, v, jnp.asarray(segments)


def attention_loss_and_grads(implementation, form, q, k, v, segments):
    """((loss, d loss / d(q, k, v)), the program's text as lowered for the default backend)."""
    packed, max_segments = FORMS[form]
    segments = segments if packed else None
    # Fixed random weights, so the gradient reaching each output position differs; squared, so
    # the loss is a sum of positive terms, not a small difference of large ones.
    weights = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, q.shape), jnp.float32)

    def loss(q, k, v):
        out = attend(q, k, v, segments, implementation, max_segments=max_segments)
        return jnp.mean(jnp.square(out.astype(jnp.float32) * weights))
    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    return fn(q, k, v), fn.lower(q, k, v).as_text()


def assert_close(got, want, tol=2e-2):
    """Loss and gradients within `tol` of `want` relative to each one's norm, and within 2 x `tol`
    elementwise relative to its largest value. Each side is a bfloat16 approximation of the same
    float32 result: on an H100 cuDNN and XLA are each ~3e-3 (norm) from it (benchmarks/RESULTS.md,
    "Attention on packed rows"); on CPU, for these inputs, XLA's bfloat16 path is within 4e-3
    (norm) and 9e-3 (largest element), so the two sides differ by ~1e-2 and 2e-2 at most. Bugs
    are far off: documents seeing each other 0.3 to 0.6, a softmax scale 10% off 6e-2 or more."""
    for name, a, b in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        norm_error = np.linalg.norm(a - b) / np.linalg.norm(b)
        max_error = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert norm_error < tol and max_error < 2 * tol, (
            f"{name}: relative error {norm_error:.2e} (norm), {max_error:.2e} (largest element)")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("form", list(FORMS))
def test_cudnn_attention_matches_xla(gpu, form, head_dim):
    """cuDNN's kernel, in `form`, gives XLA's loss and gradients (causal, grouped-query)."""
    if form == "packed layout" and not packed_layout_bound(str(gpu.compute_capability), 4, False):
        pytest.skip(f"cuDNN's packed layout needs a Hopper GPU or newer, not {gpu.device_kind}")
    inputs = attention_inputs(head_dim)
    got, program = attention_loss_and_grads("cudnn", form, *inputs)
    want, _ = attention_loss_and_grads("xla", form, *inputs)
    # cuDNN's calls for this form, forward and backward: not XLA's path, nor another form's (the
    # mask form is the one with a bias).
    calls = set(re.findall(r"custom_call @\"?(__cudnn\$\w+)", program))
    assert calls == {CUDNN_CALL[form], CUDNN_CALL[form] + "Backward"}, calls
    assert_close(got, want)


# --- (b) the train step on the GPU against the CPU ---------------------------------------------

STEPS = 8


def train_losses(device, attention, max_segments, workdir):
    """{step: loss} of configs/tiny.py trained STEPS steps on `device` alone (one-device mesh)."""
    config = runpy.run_path(os.path.join(REPO, "configs", "tiny.py"))["get_config"]()
    config.train.update(steps=STEPS, log_every=1, eval_every=0)
    config.optim.warmup_steps = 2  # the full learning rate soon, so the loss moves within STEPS
    config.model.attention = attention
    config.data.max_segments = max_segments
    config.checkpoint.update(enabled=False, compilation_cache=False)
    jaxscale.Trainer(config, str(workdir), devices=[device]).run()
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


@pytest.mark.parametrize("max_segments", [0, 4], ids=["document mask", "packed layout"])
def test_train_losses_on_gpu_match_cpu(gpu, max_segments, tmp_path):
    """The same run (bfloat16 compute, same seed and batches) on the GPU with cuDNN attention, in
    the form `max_segments` picks, and on the CPU with XLA's loses the same at every step."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:
        pytest.skip("needs the CPU backend beside the GPU: JAX_PLATFORMS=cuda,cpu")
    on_gpu = train_losses(gpu, "cudnn", max_segments, tmp_path / "gpu")
    on_cpu = train_losses(cpu, "xla", max_segments, tmp_path / "cpu")
    assert list(on_gpu) == list(range(1, STEPS + 1)) == list(on_cpu)
    gpu_losses, cpu_losses = np.array(list(on_gpu.values())), np.array(list(on_cpu.values()))
    # The loss falls (5.6 to 3.3 on CPU), so they agree on a model that learns.
    assert cpu_losses[-1] < cpu_losses[0] - 1, cpu_losses
    # On CPU these 8 steps in bfloat16 lose within 2e-4 (relative) of the same run in float32:
    # bfloat16 rounding, carried through the updates, moves the loss that little. The backends
    # round differently (other kernels, other summation orders); 5e-3 leaves 25 times that, and
    # fails a step that computes something else (its loss, gradients or update). Attention's own
    # errors hardly show here (documents seeing each other move these losses by 3e-4):
    # test_cudnn_attention_matches_xla checks those.
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=5e-3)
