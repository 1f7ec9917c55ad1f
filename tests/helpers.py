"""Small configs and batches shared by the tests, and the loss and gradients on a mesh."""

import json
import math
import os
import subprocess
import sys
from typing import Any, NamedTuple

import numpy as np
import pytest

from jaxscale.config import MESH_AXES, default_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def benchmark_module(name: str):
    """benchmarks/NAME.py imported as a module. The benchmarks are scripts, not a package: run as
    `python benchmarks/NAME.py`, their folder is first on sys.path and they import their shared
    helpers (benchmarks/timing.py) as top-level modules, so it is put there here too."""
    import importlib.util

    if os.path.join(REPO, "benchmarks") not in sys.path:
        sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "benchmarks",
                                                                      f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def relative_error(got, want) -> float:
    """The largest difference, relative to the largest value wanted (float32 logits summed in
    another order than a reference's stay within 1e-5 of it)."""
    return float(np.abs(got - want).max() / np.abs(want).max())


def resumable_cli_run(workdir, steps: int, **flags) -> subprocess.CompletedProcess:
    """configs/tiny.py trained to `steps` through the CLI in float32 with `flags`, a constant
    learning rate after one warmup step and a checkpoint every 2 steps, so that a run of 2 steps
    resumed to 4 takes the same steps as a run of 4 (its losses in `workdir`/metrics.jsonl)."""
    flags = {"train.steps": steps, "train.seq_len": 64, "train.log_every": 1,
             "train.eval_every": 0, "precision.compute_dtype": "float32",
             "optim.warmup_steps": 1, "optim.min_lr_ratio": 1.0, "checkpoint.every_steps": 2,
             "checkpoint.compilation_cache": False, **flags}
    return subprocess.run(
        [sys.executable, "-m", "jaxscale.train", "--config=configs/tiny.py",
         f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in flags.items())],
        cwd=REPO, capture_output=True, text=True, timeout=600)


def resumable_cli_losses(workdir, steps: int, **flags) -> tuple[dict[int, float], str]:
    """`resumable_cli_run`, which must succeed: (its losses by step, its stdout)."""
    result = resumable_cli_run(workdir, steps, **flags)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}, result.stdout


def small_config(**mesh):
    """A 2-layer model that compiles in seconds; float32 so parity checks can be tight."""
    c = default_config()
    c.model.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128)
    c.train.update(steps=3, batch_size=8, seq_len=16, log_every=1, eval_every=0)
    c.precision.compute_dtype = "float32"
    c.optim.warmup_steps = 1
    c.mesh.update(data=1, fsdp=1, tensor=1)
    c.mesh.update(**mesh)
    return c


TEXTS = [f"document {i}: " + "abc" * (i % 17) for i in range(120)]


def one_line_error(error_type, build):
    """The message of the `error_type` that `build()` raises, checked to be one line."""
    with pytest.raises(error_type) as raised:
        build()
    message = str(raised.value)
    assert "\n" not in message
    return message


def config_with(*specs, **data):
    """The default config reading `specs` as its data sources, with small batches."""
    config = default_config()
    config.train.update(batch_size=8, seq_len=32)
    config.data.sources = tuple(specs)
    config.data.update(data)
    return config


def random_batch(config, seed=0):
    """A [batch, seq_len] batch of random tokens with two packed documents per row and padding."""
    rng = np.random.default_rng(seed)
    b, l = config.train.batch_size, config.train.seq_len
    tokens = rng.integers(3, config.model.vocab_size, size=(b, l + 1), dtype=np.int32)
    split = l // 2
    segment_ids = np.where(np.arange(l) < split, 1, 2).astype(np.int32)
    segment_ids = np.broadcast_to(segment_ids, (b, l)).copy()
    segment_ids[:, -2:] = 0  # padding at the end of every row
    positions = np.where(np.arange(l) < split, np.arange(l), np.arange(l) - split)
    return dict(
        inputs=tokens[:, :-1], targets=tokens[:, 1:],
        loss_mask=(segment_ids > 0).astype(np.float32), segment_ids=segment_ids,
        positions=np.broadcast_to(positions, (b, l)).astype(np.int32).copy())


def model_attention_mask(segment_ids):
    """bool[batch, q, k]: what the model lets query q attend to: causal, within its segment."""
    from jaxscale.parallel.attention import segment_mask

    length = segment_ids.shape[-1]
    same_segment = np.asarray(segment_mask(np.asarray(segment_ids)))[:, 0]
    return same_segment & np.tril(np.ones((length, length), bool))


def jitted(model, method: str):
    """`model.method(*args)` under jit, one compile per shape (eager, the scanned layers run op
    by op, many times slower); a Python int argument is traced."""
    import functools

    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, *args: getattr(nnx.merge(graphdef, state), method)(*args))
    return functools.partial(run, state)


def mesh_devices(config):
    """The first devices, as many as `config`'s (ICI) mesh sizes multiply to."""
    import jax

    return jax.devices()[:math.prod(config.mesh[a] for a in MESH_AXES)]


def mesh_trainer(config, workdir):
    """A Trainer on `mesh_devices(config)`."""
    from jaxscale.trainer import Trainer

    return Trainer(config, str(workdir), devices=mesh_devices(config))


class MeshLossAndGradients(NamedTuple):
    loss: Any  # the mean loss over the batch's counted tokens (+ MoE router penalties)
    grads: Any  # its gradient with respect to the parameters
    hlo: str  # the compiled computation, to look for its collectives


def loss_and_gradients_on_mesh(config, workdir, batch=None) -> MeshLossAndGradients:
    """The mean loss of `batch` (default: `random_batch`) at `config`'s initial parameters and its
    gradient, computed on `config`'s mesh through the train step's own loss and gradient. The batch
    goes in as the input pipeline lays it out: in the load-balanced order over the context axis."""
    import jax
    import jax.numpy as jnp

    from jaxscale.parallel.context import length_shards, load_balanced
    from jaxscale.parallel.sharding import with_rules
    from jaxscale.training.step import Objective, Weights

    program = mesh_trainer(config, workdir).program
    params = program.init_state(config.train.seed).params
    batch = random_batch(config) if batch is None else batch
    shards = length_shards(program.batch_sharding, batch["inputs"].shape)
    assert shards == config.mesh.context  # the sequences are split over the context axis alone
    batch = jax.device_put(load_balanced(batch, shards), program.batch_sharding)

    def mean_loss_and_grad(params, batch):
        tokens = jnp.sum(batch["loss_mask"])
        objective = Objective.of(config, program.model.graphdef, program.pipeline)
        total, grads, _, _ = objective.forward_backward(Weights(params), batch, 1 / tokens)
        return total / tokens, grads
    # Compiled ahead of time and called as compiled: one compilation gives the HLO and the values.
    step = jax.jit(with_rules(mean_loss_and_grad, program.mesh, program.rules))
    compiled = step.lower(params, batch).compile()
    loss, grads = jax.device_get(compiled(params, batch))
    return MeshLossAndGradients(loss, grads, compiled.as_text())


def saved_with_norms_off_one(model, folder) -> str:
    """`model`, a transformers model, saved to `folder` with every RMSNorm's scale drawn from
    [0.5, 1.5] (torch's generator as seeded), so that a swapped or missing norm moves its logits;
    returns the folder."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return str(folder)


def float64_rotation(rotary, head_dim: int, theta: float | dict[str, float],
                     linear_factor: dict[str, float] | None = None) -> None:
    """Gives a transformers model's rotary embedding (`model.model.rotary_emb`) cos/sin computed
    in float64. transformers forms position x frequency in float32 whatever the model's dtype,
    ~4e-4 rad off at position 4096 and ~2e-3 at 40000; jaxscale's rotation is checked against
    float64 on its own (tests/test_hf.py), so a comparison past those positions then compares
    all the rest. `theta`: the base, or one per layer type (Gemma 3's forward takes the type);
    `linear_factor`: per layer type, the factor linear RoPE scaling divides frequencies by."""
    import torch

    def forward(x, position_ids, layer_type=None):
        base = theta if layer_type is None else theta[layer_type]
        inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
        inv_freq /= (linear_factor or {}).get(layer_type, 1.0)
        angles = position_ids.numpy()[..., None].astype(np.float64) * inv_freq
        angles = np.concatenate([angles, angles], axis=-1)
        return (torch.tensor(np.cos(angles), dtype=x.dtype),
                torch.tensor(np.sin(angles), dtype=x.dtype))
    rotary.forward = forward


def exported_like_a_trained_model(config, folder) -> tuple[Any, Any, str, dict]:
    """(model, its config, folder, the exported config.json) for `config`'s model in float32,
    its init scaled up (the norms away from 1) as a trained model's weights are, and exported by
    jaxscale.hf.save_model to `folder`."""
    import jax
    from flax import nnx

    from jaxscale import hf
    from jaxscale.models.spec import create_model, model_config

    config.precision.compute_dtype = "float32"
    cfg = model_config(config)
    graphdef, state = nnx.split(create_model(cfg, 0))
    state = jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x * 0.75, state)
    model = nnx.merge(graphdef, state)
    hf.save_model(model, cfg, str(folder), "float32")
    with open(os.path.join(str(folder), "config.json"), encoding="utf-8") as f:
        return model, cfg, str(folder), json.load(f)


def assert_imports_back_bit_for_bit(model, cfg, folder) -> None:
    """`folder`, an export of `model` (config `cfg`) in float32, imports back by
    jaxscale.hf.load_model as the same config and the same parameters, bit for bit (the padded
    vocabulary rows aside: they are not exported)."""
    import jax
    from flax import nnx

    from jaxscale import hf

    again, cfg_again = hf.load_model(str(folder), compute_dtype="float32")
    assert cfg_again == cfg
    ours, back = (nnx.to_pure_dict(nnx.state(m, nnx.Param)) for m in (model, again))
    for params in (ours, back):
        params["embed"] = params["embed"][:cfg.vocab_size]
        if "head" in params:
            params["head"] = params["head"][:, :cfg.vocab_size]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 ours, back)


def assert_shipped_config_is_published(config_name: str, published: dict, model_class,
                                       config_class, folder):
    """configs/<config_name>.py exports `published` (a config.json's keys), that config.json
    imports (configs/hf.py's way) as its model section, and the model has as many parameters as
    transformers' `model_class` of `config_class(**published)` (built on the meta device). Returns
    the model's spec, for a family's own checks."""
    import torch

    from jaxscale.cli import load_config_file
    from jaxscale.hf.config import hf_config, model_section
    from jaxscale.models.spec import model_spec

    config = load_config_file(os.path.join(REPO, "configs", f"{config_name}.py"))
    spec = model_spec(config)
    exported = hf_config(spec.config, "bfloat16")
    assert {k: exported[k] for k in published} == published
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(published, f)
    section = model_section(str(folder))
    assert section.pop("rope_scaling") == dict(type="none")
    assert section == {key: config.model[key] for key in section}
    with torch.device("meta"):
        reference = model_class(config_class(**published))
    assert spec.num_params == reference.num_parameters()
    return spec
