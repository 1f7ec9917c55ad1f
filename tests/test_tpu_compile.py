"""The train step compiled by the real TPU compiler for a TPU slice this machine does not have
(libtpu, in the test extra, compiles for a topology description)."""

import os
import re
import subprocess
import sys

import pytest

from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.targets import parse_target, target_devices
from tests.helpers import small_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Attention scores of the XLA path: [batch, (kv) heads, (group,) 256 queries, 256 keys] per device.
SCORES = re.compile(r"\[(\d+,){2,}256,256\]")


def splash_step_config():
    """A 2-layer step for 4 chips (fsdp=4) with splash-sized heads and the loss in slices."""
    config = small_config(fsdp=4)
    config.train.update(seq_len=256, batch_size=8)
    config.model.update(head_dim=128, loss_chunk_len=64)
    return config


@pytest.fixture(scope="module")
def v5p_devices():
    return target_devices(parse_target("v5p:2x2x1"))


def test_splash_attention_and_chunked_loss_compile_for_a_tpu(v5p_devices):
    """`model.attention=auto` picks the Pallas splash kernel for TPU devices: the compiled program
    calls the Mosaic kernel, has no [batch, heads, q, k] score tensors, and reports its memory."""
    compiled, memory = compile_train_step(splash_step_config(), v5p_devices)
    hlo = compiled.as_text()
    assert "tpu_custom_call" in hlo
    assert not SCORES.search(hlo)
    assert 0 < memory.arguments and 0 < memory.temporaries


def test_the_xla_path_compiles_for_a_tpu_and_materialises_the_scores(v5p_devices):
    """The same step with `model.attention=xla`: no kernel call, and the scores are there (so the
    check above can fail)."""
    config = small_config(fsdp=4)
    config.train.update(seq_len=256, batch_size=8)
    config.model.update(head_dim=128, attention="xla")
    hlo = compile_train_step(config, v5p_devices)[0].as_text()
    assert "tpu_custom_call" not in hlo
    assert SCORES.search(hlo)


@pytest.mark.parametrize("every", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_sliding_window_compiles_to_the_splash_kernel_for_a_tpu(v5p_devices, every):
    """A window of 64 in every layer (Mistral's form) or in every other one (Gemma 3's, the
    kernel chosen per layer by a cond) still runs the Mosaic kernel, forward and backward, with
    no score tensors."""
    config = splash_step_config()
    config.model.update(sliding_window=64, global_every=every)
    hlo = compile_train_step(config, v5p_devices)[0].as_text()
    assert "tpu_custom_call" in hlo
    assert not SCORES.search(hlo)
    assert (" conditional(" in hlo) == bool(every)


def test_targets_name_chips():
    assert parse_target("v5p-64").topology == "v5p:4x4x4"
    assert parse_target("v5e-16").topology == "v5e:4x4"
    assert parse_target("v5p:2x2x1").num_devices == 4
    assert parse_target("cpu:8").num_devices == 8


def test_a_two_slice_target_plans_over_dcn_and_compiles_for_both_slices():
    """`2xv5e-4`: 8 chips in 2 slices. The TPU compiler describes both (each device knows its
    slice), the search splits the slices over the DCN axes, and the chosen layout compiles."""
    from jaxscale.plan.planner import make_plan

    target = parse_target("2xv5e-4")
    assert (target.num_devices, target.granules, target.topology) == (8, 2, "v5e:2x2")
    devices = target_devices(target)
    assert sorted({d.slice_index for d in devices}) == [0, 1]
    config = small_config()
    config.precision.compute_dtype = "bfloat16"
    config.train.update(batch_size=16, seq_len=256)
    config.model.head_dim = 128
    plan = make_plan(config, target, top=1)
    dcn = {a: plan.chosen.candidate.apply(config).mesh.dcn[a] for a in ("data", "fsdp",
                                                                      "pipeline")}
    assert sorted(dcn.values()) == [1, 1, 2]  # the two slices split one axis
    assert plan.chosen.compiled is not None


PEAK_SCRIPT = """
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.targets import parse_target, target_devices
from tests.test_tpu_compile import splash_step_config
memory = compile_train_step(splash_step_config(), target_devices(parse_target("v5p:2x2x1")))[1]
print(memory.arguments, memory.total, memory.peak)
"""


@pytest.mark.slow  # compiles for a TPU slice (about 12 s)
def test_the_tpu_compilers_peak_lies_within_its_buffers_and_the_total_overstates(tmp_path):
    """`StepMemory.peak`, checked against the compiler's buffer assignment (dumped by XLA): it
    is more than the arguments and at most the allocations in the device's main memory (those
    with no other memory colour). The breakdown's `total` exceeds even their sum: the TPU's
    temporaries count more than its main-memory heap, which is why benchmarks/memory.py compares
    peaks."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=train_step")
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], env=env, cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    arguments, total, peak = map(int, out.split()[-3:])
    [assignment] = tmp_path.glob("*train_step*after_optimizations-buffer-assignment.txt")
    allocations = re.findall(r"^allocation \d+: size (\d+), (.*)$", assignment.read_text(), re.M)
    main_memory = sum(int(size) for size, what in allocations if "color" not in what)
    assert arguments < peak <= main_memory < total
