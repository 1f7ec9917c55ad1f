"""GPU targets compiled on this CPU host by XLA's GPU compiler (JAX's CUDA plugin, the
gpu-compile extra, which CI installs): every GPU description shipped compiles a step; the planner
compiles GPU candidates and reads their memory and collectives; the step a GPU runs by default
has no layer loop and takes bfloat16 operands in every matmul; the launchers refuse a step that
does not fit the GPUs before anything is rendered."""

import collections
import os
import re
import subprocess
import sys

import pytest

from jaxscale.cli import load_config_file
from jaxscale.models.spec import model_spec
from jaxscale.plan import rank
from jaxscale.plan.collectives import bytes_by_kind, parse_collectives
from jaxscale.plan.compiled import compile_train_step
from jaxscale.plan.planner import make_plan
from jaxscale.plan.report import header
from jaxscale.plan.search import Candidate, layout
from jaxscale.plan.targets import parse_target, target_devices
from jaxscale.runtime import cuda_plugin
from jaxscale.runtime.chips import GIB, chip_for_device_kind
from jaxscale.training.step_settings import FAST, LEAN
from tests.helpers import REPO, small_config

pytestmark = pytest.mark.skipif(
    not cuda_plugin.installed(),
    reason=f"needs XLA's GPU compiler: {cuda_plugin.INSTALL_HINT} (CI installs it)")


def bfloat16_config():
    config = small_config()
    config.precision.compute_dtype = "bfloat16"
    return config


def dots(hlo: str) -> collections.Counter:
    """(output, lhs, rhs) dtypes of every dot of a compiled program, counted."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    return collections.Counter(
        (out, types.get(lhs), types.get(rhs)) for out, lhs, rhs in
        re.findall(r"= (\w+)\[[^\]]*\]\{[^}]*\} dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo))


@pytest.mark.parametrize("gpu, kind", [("h100", "H100 SXM"), ("h200", "H200"),
                                       ("a100", "A100")])
def test_each_gpu_description_compiles_a_step(gpu, kind):
    devices = target_devices(parse_target(f"{gpu}:1"))
    assert len(devices) == 1 and devices[0].platform == "gpu"
    assert chip_for_device_kind(devices[0].device_kind).name == kind
    _, memory = compile_train_step(bfloat16_config(), devices)
    assert 0 < memory.total < 0.1 * GIB


@pytest.mark.slow  # compiles the GPU step (about 13 s)
def test_a_gpu_runs_its_layers_unrolled_with_whole_logits_and_bfloat16_matmuls():
    """The default step on an H100: no layer loop, no stack written a layer at a time, cuDNN's
    attention, and every matmul on bfloat16 operands (the logits' gradient too). The lean
    settings' program, for contrast, loops over the layers and writes their stacks."""
    devices = target_devices(parse_target("h100:1"))
    fast, _ = compile_train_step(bfloat16_config(), devices)
    hlo = fast.as_text()
    assert " while(" not in hlo and "dynamic-update-slice(" not in hlo
    assert "__cudnn$fmha" in hlo
    found = dots(hlo)
    assert sum(found.values()) >= 20  # the forward and backward matmuls of 2 layers and the head
    assert {(lhs, rhs) for _, lhs, rhs in found} == {("bf16", "bf16")}, found
    lean, _ = compile_train_step(LEAN.apply(bfloat16_config()), devices)
    assert " while(" in lean.as_text() and "dynamic-update-slice(" in lean.as_text()


@pytest.mark.parametrize("every", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_sliding_window_compiles_to_cudnns_attention_with_the_window(every):
    """A window of 8 in every layer (Mistral's form) on an H100, packed rows as a document mask:
    cuDNN's fused attention, forward and backward, each call carrying the window; in every
    other layer (Gemma 3's, chosen per layer by a cond) calls with the window and calls without.
    (The packed layout's form, `data.max_segments`, takes the window too, but JAX refuses to
    build it on a host without a Hopper GPU.)"""
    config = bfloat16_config()
    config.model.update(sliding_window=8, global_every=every)
    hlo = compile_train_step(config, target_devices(parse_target("h100:1")))[0].as_text()
    calls = re.findall(r'custom_call_target="__cudnn\$fmha[^"]*".*', hlo)
    assert len(calls) >= 4, calls  # forward and backward of 2 layers
    windows = {re.search(r'"sliding_window_length": ?(\d+)', call)[1] for call in calls}
    assert windows == ({"8", "0"} if every else {"8"}), windows


@pytest.mark.slow  # compiles GPU candidates (about 11 s)
def test_the_planner_compiles_gpu_candidates_for_two_nodes():
    """h100:2x8: 16 devices in 2 processes; the candidates compiled, their memory the
    compiler's, their collectives read from the program, each with the GPU's step settings."""
    plan = make_plan(bfloat16_config(), parse_target("h100:2x8"), top=1)
    assert plan.target.compiles and "compiled for the target" in header(plan)
    compiled = [row for row in plan.rows if row.compiled]
    assert compiled and plan.chosen in compiled
    assert plan.chosen.candidate.step == FAST
    assert 0 < plan.chosen.compiled.total < 0.1 * GIB
    assert plan.chosen.collectives  # read from the compiled program
    devices = target_devices(plan.target)
    assert len(devices) == 16 and {d.process_index for d in devices} == {0, 1}


def test_fsdp_within_nodes_and_data_across_them_collect_over_their_own_axes():
    """fsdp=8 inside each node, data=2 across the two: the weights are gathered and their
    gradients reduce-scattered over the node's GPUs, and the gradients summed across the nodes,
    over the network."""
    config = bfloat16_config()
    config.train.batch_size = 16
    config.mesh.update(data=1, fsdp=8)
    config.mesh.dcn.data = 2
    compiled, _ = compile_train_step(config, target_devices(parse_target("h100:2x8")))
    found = parse_collectives(compiled.as_text(), dict(data=2, fsdp=8, tensor=1, pipeline=1),
                              dict(data=1, fsdp=8, tensor=1, pipeline=1))
    by_axes = {(c.kind, c.axes, c.crosses_dcn) for c in found}
    assert {("all-gather", ("fsdp",), False), ("reduce-scatter", ("fsdp",), False)} <= by_axes
    assert ("all-reduce", ("data",), True) in by_axes, by_axes


@pytest.mark.slow  # 20 s of compiling; tests/test_plan.py reads each asynchronous form fast
def test_gpu_collectives_move_the_bytes_the_analytic_model_counts():
    """A GPU starts its collectives asynchronously (`all-to-all-start` returns its operands with
    its outputs): read right, tiny_moe's all-to-alls over expert=4 move exactly the dispatch
    buffers the analytic model counts (twice that before), and tiny's gradients are
    reduce-scattered over fsdp=8 once, not once per device and more."""
    devices = target_devices(parse_target("h100:8"))

    def moved(config, mesh, remat, axis):
        candidate = Candidate(*layout(mesh), remat, 1, "params")
        config = candidate.apply(config)
        compiled, _ = compile_train_step(config, devices)
        found = parse_collectives(compiled.as_text(), candidate.mesh_shape)
        counted = rank.analytic_collectives(config, model_spec(config), candidate, 1)
        return [bytes_by_kind([f for f in collectives if f.axes == (axis,)])
                for collectives in (found, counted)]

    moe = load_config_file("configs/tiny_moe.py")
    moe.precision.compute_dtype = "bfloat16"
    found, counted = moved(moe, {"data": 2, "expert": 4}, "none", "expert")
    assert found["all-to-all"] == counted["all-to-all"] > 0
    dense = bfloat16_config()
    dense.train.batch_size = 16
    found, counted = moved(dense, {"fsdp": 8}, "none", "fsdp")
    # (XLA keeps the forward's gathered weights for the backward; the model gathers them twice)
    assert 0.75 <= found["reduce-scatter"] / counted["reduce-scatter"] <= 1.0


def _fit(*args):
    return subprocess.run([sys.executable, "-m", "jaxscale.launch.fit", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow  # two launch.fit processes, each compiling for the GPUs (about 20 s)
def test_launch_fit_compiles_for_the_gpus_and_refuses_a_step_that_does_not_fit():
    ok = _fit("--devices=8", "--gpu=h100", "--", "--config=configs/tiny.py")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert re.fullmatch(r"compiled for h100:1x8: [\d.]+ GiB per GPU, within 60 GiB \(75% of an? "
                        r"H100 SXM's 80 GiB, XLA_PYTHON_CLIENT_MEM_FRACTION\)\n", ok.stderr)
    refused = _fit("--devices=8", "--gpu=h100", "--", "--config=configs/tiny.py",
                   "--config.performance.device_memory_gib=0.001")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-2000:]
    assert lines[0].startswith("error: the train step does not fit: per device it needs")
    assert lines[0].endswith("(compiled for h100:1x8)")


@pytest.mark.slow  # 12-20 s of compiling
def test_launch_gke_refuses_a_step_that_does_not_fit_before_rendering_anything():
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.launch.gke", "--config=configs/tiny.py", "--nodes=2",
         "--gpus_per_node=8", "--image=img:1", "--bucket=ckpts",
         "--config.performance.device_memory_gib=0.001"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert len(lines) == 1 and lines[0].endswith("(compiled for h100:2x8)")


@pytest.mark.slow  # 12-20 s of compiling
def test_fp8_meta_is_kept_for_the_whole_stack_at_once():
    """The fp8 matmuls' scale and history bookkeeping runs once a step for every layer of the
    stack (jaxscale/models/fp8.py `step_meta`, `next_meta`), not per layer: compiled for an
    H100, the step of 4 layers writes histories in place as often as the step of 2 (per layer,
    the 4 would write 84 times, the 2 42)."""
    def in_place_updates(layers):
        config = bfloat16_config()
        config.model.n_layers = layers
        config.precision.matmul = "fp8"
        compiled, _ = compile_train_step(config, target_devices(parse_target("h100:1")))
        return compiled.as_text().count("dynamic-update-slice(")

    two, four = in_place_updates(2), in_place_updates(4)
    assert two == four <= 3 * 7  # at most one per operand of each of a layer's 7 matmuls
