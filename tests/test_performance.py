"""Seeing where time and memory go (docs/performance.md): the profiler window, device memory in
the metrics, the train step's compiled memory, bfloat16 Adam moments and optimizer-state offload."""

import functools
import glob
import gzip
import json
import os
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from helpers import random_batch, small_config
from jax.sharding import PartitionSpec as P

from jaxscale.errors import ConfigError
from jaxscale.models.spec import model_spec
from jaxscale.observe import profiling
from jaxscale.observe.device_memory import memory_metrics
from jaxscale.parallel.sharding import rules_from_config
from jaxscale.plan.targets import parse_target, target_devices
from jaxscale.runtime.workdir import logged_metrics
from jaxscale.trainer import Trainer
from jaxscale.training import offload
from jaxscale.training.layout import StateLayout
from jaxscale.training.optim import make_optimizer

GIB = 2 ** 30


def traced_steps(directory) -> list[list[int]]:
    """For each trace file under `directory`: the step numbers of its `train` step annotations."""
    files = sorted(glob.glob(os.path.join(directory, "plugins", "profile", "*", "*.trace.json.gz")))
    traces = []
    for path in files:
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
        traces.append(sorted(int(e["args"]["step_num"]) for e in events
                             if e.get("name") == "train"))
    return traces


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


# --- the profiler window ---------------------------------------------------------------------

def profile(start_step=0, steps=0, all_processes=False):
    return ml_collections.ConfigDict(dict(start_step=start_step, steps=steps,
                                          all_processes=all_processes))


def run_steps(window, steps):
    for step in steps:
        with window.annotate(step):
            out = jnp.ones(4) * step
        window.step_done(step, out)


@pytest.mark.parametrize("process, all_processes, traced", [
    (0, False, True), (1, False, False), (1, True, True)])
def test_only_the_chosen_processes_trace(tmp_path, monkeypatch, process, all_processes, traced):
    monkeypatch.setattr(jax, "process_index", lambda: process)
    window = profiling.ProfileWindow(profile(1, 2, all_processes), str(tmp_path))
    run_steps(window, range(4))
    window.close()
    written = os.listdir(tmp_path / "profile") if (tmp_path / "profile").exists() else []
    assert written == ([f"process_{process}"] if traced else [])
    if traced:
        assert traced_steps(tmp_path / "profile" / f"process_{process}") == [[1, 2]]


def test_a_window_cut_short_is_still_written(tmp_path):
    window = profiling.ProfileWindow(profile(1, 10), str(tmp_path))
    run_steps(window, range(3))  # the run stops (SIGTERM, last step) inside the window
    assert window.tracing
    window.close()
    assert not window.tracing
    assert traced_steps(tmp_path / "profile" / "process_0") == [[1, 2]]


def test_a_run_resumed_inside_the_window_traces_the_rest(tmp_path):
    window = profiling.ProfileWindow(profile(2, 4), str(tmp_path))
    run_steps(window, range(4, 8))
    assert traced_steps(tmp_path / "profile" / "process_0") == [[4, 5]]


@pytest.mark.parametrize("start, steps, total, ok", [
    (0, 0, 5, True), (0, 5, 5, True), (4, 1, 5, True), (4, 2, 5, False), (-1, 1, 5, False),
    (99, 0, 5, True), (0, -1, 5, False)])
def test_the_window_must_lie_inside_the_run(start, steps, total, ok):
    if ok:
        profiling.check_window(profile(start, steps), total)
    else:
        with pytest.raises(ConfigError, match="profile."):
            profiling.check_window(profile(start, steps), total)


# --- device memory ---------------------------------------------------------------------------

def test_memory_metrics_take_the_fullest_device():
    devices = [FakeDevice({"bytes_in_use": 3 * GIB, "peak_bytes_in_use": 5 * GIB,
                           "bytes_limit": 80 * GIB}),
               FakeDevice({"bytes_in_use": 4 * GIB, "peak_bytes_in_use": 4.5 * GIB,
                           "bytes_limit": 80 * GIB})]
    assert memory_metrics(devices) == {"memory_in_use_gib": 4.0, "memory_peak_gib": 5.0,
                                       "memory_limit_gib": 80.0}


def test_memory_metrics_are_absent_where_the_backend_reports_none():
    assert memory_metrics(jax.devices()) == {}  # CPU: memory_stats() is None
    assert memory_metrics([FakeDevice(None), FakeDevice({})]) == {}
    assert memory_metrics([FakeDevice({"bytes_in_use": GIB})]) == {"memory_in_use_gib": 1.0}


# --- bfloat16 moments ------------------------------------------------------------------------

def reference_adamw(params, grads_per_step, optim, lr_per_step):
    """AdamW in float64 numpy, written out from the paper (no optax), decay on every entry."""
    mu = {k: np.zeros_like(v) for k, v in params.items()}
    nu = {k: np.zeros_like(v) for k, v in params.items()}
    params = {k: v.astype(np.float64) for k, v in params.items()}
    for t, (grads, lr) in enumerate(zip(grads_per_step, lr_per_step), start=1):
        for k in params:
            g = grads[k].astype(np.float64)
            mu[k] = optim.b1 * mu[k] + (1 - optim.b1) * g
            nu[k] = optim.b2 * nu[k] + (1 - optim.b2) * g * g
            mu_hat, nu_hat = mu[k] / (1 - optim.b1 ** t), nu[k] / (1 - optim.b2 ** t)
            update = mu_hat / (np.sqrt(nu_hat) + optim.eps) + optim.weight_decay * params[k]
            params[k] = params[k] - lr * update
    return params


def optimizer_run(moment_dtype, steps=20):
    optim = small_config().optim
    optim.update(moment_dtype=moment_dtype, grad_clip=0.0, warmup_steps=0, lr=1e-2,
                 min_lr_ratio=1.0, b2=0.95)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(64, 32)).astype(np.float32),
              "v": rng.normal(size=(128, 16)).astype(np.float32)}
    specs = {"w": P("embed", "mlp"), "v": P("vocab", "embed")}  # both decayed
    # Gradients of very different sizes, as a network's are.
    grads = [{k: (rng.normal(size=v.shape) * 10.0 ** rng.uniform(-4, 1, size=v.shape))
              .astype(np.float32) for k, v in params.items()} for _ in range(steps)]
    tx, schedule = make_optimizer(optim, steps, specs)
    state = tx.init(params)
    new = {k: jnp.asarray(v) for k, v in params.items()}
    update = jax.jit(tx.update)
    for g in grads:
        updates, state = update(g, state, new)
        new = optax.apply_updates(new, updates)
    lrs = [float(schedule(i)) for i in range(steps)]
    return params, new, state, reference_adamw(params, grads, optim, lrs)


def change_error(params, got, want):
    """Largest difference between the two runs' parameter changes, over the largest change."""
    return max(float(np.max(np.abs(np.asarray(got[k], np.float64) - want[k]))
                     / np.max(np.abs(want[k] - params[k]))) for k in want)


def test_float32_moments_match_an_independent_adamw():
    params, new, state, reference = optimizer_run("float32")
    assert change_error(params, new, reference) < 1e-5  # float32 rounding only


def test_bfloat16_moments_stay_close_to_float32_adamw_in_half_the_bytes():
    params, new, state, reference = optimizer_run("bfloat16")
    adam = state[0][0]  # no clipping: the chain holds adamw's chain, Adam first
    for moment in (adam.mu, adam.nu):
        assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(moment))
    _, _, state32, _ = optimizer_run("float32", steps=1)
    def nbytes(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))
    adam32 = state32[0][0]
    assert nbytes((adam.mu, adam.nu)) * 2 == nbytes((adam32.mu, adam32.nu))
    # bfloat16 keeps 8 significand bits: each stored moment is off by up to 2^-9 relative, and
    # so is each update mu/sqrt(nu). Over 20 steps the parameters' changes stay within 1% of
    # float32 AdamW's largest change (measured: 0.35%), and differ from them by more than float32
    # rounding does (< 1e-5, above): the moments are really stored in bfloat16.
    error = change_error(params, new, reference)
    assert 1e-4 < error < 1e-2, error


# --- host offload ----------------------------------------------------------------------------

def test_offload_is_refused_where_the_devices_have_no_host_memory():
    device = types.SimpleNamespace(
        process_index=0, platform="tpu", device_kind="TPU v9",
        addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
    with pytest.raises(ConfigError, match="optim.offload_state=True: tpu devices"):
        offload.check_supported([device])
    offload.check_supported(jax.devices())  # XLA:CPU has pinned_host memory


def _optimizer(offloaded: bool, moment_dtype: str, slices=None):
    optim = ml_collections.ConfigDict(dict(
        lr=1e-2, warmup_steps=1, min_lr_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
        grad_clip=0.5, moment_dtype=moment_dtype, offload_state=offloaded))
    specs = {"layers": {"w": P("layers", "embed", "mlp"), "scale": P("layers", "embed")},
             "head": P("embed", "vocab")}
    return make_optimizer(optim, 10, specs, slices)[0]


@pytest.mark.parametrize("stack_grad_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_the_streamed_update_equals_one_update_of_every_parameter(moment_dtype, sliced,
                                                                   stack_grad_dtype):
    """Offloaded moments stream through the update a parameter (or a slice of one: a layer of a
    stacked one, rows of another) at a time: the same updates, new parameters (`apply`) and state
    as the update of the whole tree on the device, clipped by the whole gradient's norm, the
    moments back in host memory, and a dropped step (keep=False) changes no state and no parameter.
    A stack's gradient may come in bfloat16 (as the train step passes it): each update widens it,
    and equals the update of the float32 gradient of the same values."""
    rng = np.random.default_rng(0)
    params = {"layers": {"w": rng.normal(size=(3, 4, 8)), "scale": rng.normal(size=(3, 4))},
              "head": rng.normal(size=(16, 4))}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    made = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
            for _ in range(3)]
    for g in made:
        g["layers"]["w"] = g["layers"]["w"].astype(stack_grad_dtype)
    grads = [jax.tree.map(lambda x: x.astype(jnp.float32), g) for g in made]  # widened
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")

    def moments_on_host(tx, state):
        return optax.tree_map_params(tx, lambda x: jax.device_put(x, host), state)

    results = {}
    for offloaded in (False, True):
        # Sliced: the stack a layer at a time, the head in two slices of 8 rows.
        tx = _optimizer(offloaded, moment_dtype,
                        {"layers": {"w": 3, "scale": 3}, "head": 2} if sliced else None)
        state = tx.init(params)
        if offloaded:
            state = moments_on_host(tx, state)
        update = jax.jit(tx.update, static_argnames="apply")
        outputs = []
        # The plain update takes the widened gradients, the streamed one as they were made.
        for keep, g in zip((True, True, False), made if offloaded else grads):
            before = state
            updates, _ = update(g, state, params, keep=jnp.asarray(keep))
            new_params, state = update(g, state, params, keep=jnp.asarray(keep), apply=True)
            outputs.append((updates, new_params))
            if not keep:
                jax.tree.map(np.testing.assert_array_equal, state, before)
                jax.tree.map(np.testing.assert_array_equal, new_params, params)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state[1][0].mu)}
        assert kinds == {"pinned_host" if offloaded else "device"}
        results[offloaded] = jax.device_get((outputs, state))
        if not offloaded:  # the plain update widens them too, to the same values
            made_update = jax.jit(tx.update)(made[0], tx.init(params), params)
            jax.tree.map(np.testing.assert_array_equal, made_update,
                         jax.jit(tx.update)(grads[0], tx.init(params), params))

    def close(plain, streamed):  # XLA may fuse the two programs' float ops differently
        plain, streamed, bf16 = np.float32(plain), np.float32(streamed), plain.dtype != np.float32
        rtol = 2 ** -7 if bf16 else 1e-5  # bfloat16: within 1 ulp
        np.testing.assert_allclose(streamed, plain, rtol=rtol, atol=1e-6 * np.abs(plain).max())
    jax.tree.map(close, results[False], results[True])
    # Clipped by the norm of the whole gradient (0.5 here), not each parameter's own.
    assert optax.tree.norm(grads[0]) > 0.5


def test_offloaded_moments_stream_in_slices_of_a_dimension_no_device_splits():
    """`StateLayout(...).slices`: a stacked parameter streams a layer at a time; the embedding in
    the fewest slices of a multiple of 8 rows no larger than the largest layer (small_config: an MLP
    weight's 64 x 128; the embedding [384, 64] in 3 of 128 rows, the head [64, 384] in 4 of 16); the
    final norm (a layer's size already) and the stacks of norm scales (one row of which, in bfloat16
    host memory, the TPU compiler refuses) whole. A dimension that a device holds only part of, of
    the parameter or of its moments, streams whole: the stack on pipeline stages, the head's rows
    under fsdp, the embedding's vocabulary under tensor, and under ZeRO-1 every parameter that the
    data axes split on its first dimension."""
    config = small_config()
    spec, rules = model_spec(config), rules_from_config(config.sharding.rules)
    assert max(a.size // 2 for a in jax.tree.leaves(spec.abstract_params["blocks"])) == 64 * 128

    def slices(layout="params", **axes):
        mesh_shape = dict(data=1, pipeline=1, fsdp=1, context=1, expert=1, tensor=1) | axes
        counts = StateLayout(spec, rules, mesh_shape, layout, False).slices
        stacked = list(zip(jax.tree.leaves(counts["blocks"]),
                           jax.tree.leaves(spec.abstract_params["blocks"])))
        return ({n for n, a in stacked if a.ndim > 2}, {n for n, a in stacked if a.ndim == 2},
                counts["embed"], counts["head"], counts["final_norm"]["scale"])

    assert slices() == ({2}, {1}, 3, 4, 1)
    assert slices(fsdp=2) == ({2}, {1}, 3, 1, 1)
    assert slices(fsdp=2, pipeline=2) == ({1}, {1}, 3, 1, 1)
    assert slices(tensor=2) == ({2}, {1}, 1, 4, 1)
    # ZeRO-1 splits the embedding's and the head's moments on their rows, the stack's within a
    # layer.
    assert slices("data", data=2) == ({2}, {1}, 1, 1, 1)


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_a_stacked_parameter_streams_its_moments_a_layer_at_a_time(moment_dtype):
    """Compiled for a TPU chip (libtpu; the CPU's host memory is its device memory), the update
    of a stacked parameter whose moments are offloaded holds less than its two moments when it
    streams a layer at a time, and more when it streams the parameter whole: the loop is what
    keeps XLA from moving every layer's moments in at once. Nothing runs on the host's processor:
    the slices are copies between host and device (an index or a scatter of the host arrays ran
    there: llama3_8b's step took 6.7 s on one H200). The stack of norm scales goes whole, as
    `streamed_slices` has it (one row of it in bfloat16 host memory the TPU compiler refuses)."""
    mesh = jax.sharding.Mesh(target_devices(parse_target("v5p:2x2x1"))[:1], ("x",))
    device = jax.sharding.NamedSharding(mesh, P())
    host = device.with_memory_kind("pinned_host")
    params = {"layers": {"w": jax.ShapeDtypeStruct((16, 256, 512), jnp.float32),
                         "scale": jax.ShapeDtypeStruct((16, 256), jnp.float32)},
              "head": jax.ShapeDtypeStruct((256, 128), jnp.float32)}
    two_moments = 2 * 16 * 256 * 512 * jnp.dtype(moment_dtype).itemsize
    temporaries = {}
    for sliced in (False, True):
        tx = _optimizer(True, moment_dtype,
                        {"layers": {"w": 16, "scale": 1}, "head": 2} if sliced else None)
        state = jax.eval_shape(tx.init, params)
        state_shardings = optax.tree_map_params(tx, lambda _: host, state,
                                                transform_non_params=lambda _: device)
        # As the trainer's abstract state: each array with its sharding (the moments in host
        # memory).
        state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                             state, state_shardings)
        step = jax.jit(functools.partial(tx.update, apply=True),
                       in_shardings=(device, state_shardings, device),
                       out_shardings=(device, state_shardings), donate_argnums=(1, 2))
        compiled = step.lower(params, state, params).compile()
        temporaries[sliced] = compiled.memory_analysis().temp_size_in_bytes
        assert "HostExecute" not in compiled.as_text()
    assert temporaries[True] < two_moments < temporaries[False]


def _zero1(c):
    c.sharding.optimizer_state = "data"


def _lora(c):
    c.model.lora.rank = 4


def _moe(c):
    c.mesh.update(data=1, expert=4)
    c.model.moe.update(experts=4, every=1, top_k=2)


def _microbatches(c):
    c.train.update(microbatches=2, batch_size=16)


# Each changes what the streamed update sees: ZeRO-1 the moments' layout (a shard of each
# layer), LoRA the trained tree (adapters only, the base frozen), MoE stacked expert weights,
# microbatches a gradient summed over a loop.
OFFLOADED_WITH = [pytest.param(None, id="plain")] + [
    pytest.param(f, id=f.__name__.strip("_")) for f in (_zero1, _lora, _moe, _microbatches)]


@pytest.mark.slow
@pytest.mark.parametrize("change", OFFLOADED_WITH)
def test_an_offloaded_step_equals_one_on_the_device(tmp_path, change):
    """Two steps with the moments offloaded (the layers' weights streamed a layer at a time)
    give the state of two steps with them on the device, over a data x fsdp mesh, alone and
    with each feature that changes what the update streams."""
    states = []
    for offloaded in (False, True):
        config = small_config(data=4, fsdp=2)
        if change:
            change(config)
        config.optim.offload_state = offloaded
        trainer = Trainer(config, str(tmp_path))
        state = trainer.program.init_state(0)
        batch = {k: jax.device_put(v, trainer.program.batch_sharding)
                 for k, v in random_batch(config).items()}
        for _ in range(2):
            state, _ = trainer.program.train_step(state, batch)
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state[1][0].mu)}
        assert kinds == {"pinned_host" if offloaded else "device"}
        states.append(jax.device_get(state))
    # The same arithmetic; in the loop that streams a stacked parameter by layer XLA may order
    # a few float ops differently (1 ulp apart: 7e-9 of 0.014 here; a moment's values near 0 by
    # cancellation, 4e-10 apart, need the absolute bound).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max()), *states)


# --- a run with all of them ------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_resumed_with_bfloat16_offloaded_moments_logs_memory_and_a_profile(tmp_path):
    """A float32 run's checkpoint resumes with bfloat16 moments in host memory; the resumed run
    logs the compiled step's memory, the devices' memory (a fake GPU's) and traces its window."""
    def config(steps, **optim):
        c = small_config(data=8)
        c.train.steps = steps
        c.data.sources = (dict(format="synthetic"),)
        c.checkpoint.update(compilation_cache=False, every_steps=2)
        c.optim.update(**optim)
        return c

    Trainer(config(2), str(tmp_path)).run()
    resumed = config(5, moment_dtype="bfloat16", offload_state=True)
    resumed.profile.update(start_step=3, steps=1)
    trainer = Trainer(resumed, str(tmp_path))
    trainer.local_devices = [FakeDevice({"bytes_in_use": 2 * GIB, "peak_bytes_in_use": 3 * GIB})]
    metrics = trainer.run()

    lines = [line for line in logged_metrics(str(tmp_path)) if "loss" in line]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert all(np.isfinite(line["loss"]) for line in lines)
    assert lines[2]["step_memory_gib"] > lines[2]["step_memory_temporaries_gib"] > 0
    assert "step_memory_gib" not in lines[3]  # first line of each start only
    assert metrics["memory_peak_gib"] == 3.0 and metrics["memory_in_use_gib"] == 2.0
    assert traced_steps(tmp_path / "profile" / "process_0") == [[3]]
