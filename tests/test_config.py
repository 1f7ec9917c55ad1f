"""Bad input: every mistake is one `error:` line, exit status 2, before anything is compiled."""

import os
import subprocess
import sys

import pytest

from jaxscale.checks import validate
from jaxscale.config import MESH_AXES, default_config
from jaxscale.errors import ConfigError
from jaxscale.parallel.mesh import resolve_mesh_shape

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def expect_error(config, match, devices=8):
    with pytest.raises(ConfigError, match=match):
        validate(config, devices)


def test_defaults_are_valid_on_one_and_eight_devices():
    validate(default_config(), 1)
    validate(default_config(), 8)


@pytest.mark.parametrize("mesh", [dict(data=8), dict(data=2, fsdp=2, tensor=2),
                                  dict(data=1, fsdp=4, tensor=2), dict(fsdp=8, data=1)])
def test_tiny_config_fits_every_test_mesh(mesh):
    config = default_config()
    config.mesh.update(mesh)
    validate(config, 8)


def test_minus_one_takes_the_remaining_devices():
    config = default_config()
    config.mesh.update(data=-1, fsdp=2, tensor=2)
    ici, dcn = resolve_mesh_shape(config.mesh, 8)
    assert ici == dict(data=2, fsdp=2, tensor=2, pipeline=1, expert=1, context=1)
    assert dcn == dict(data=1, fsdp=1, tensor=1, pipeline=1, expert=1, context=1)


def test_dcn_factors_multiply_axes():
    config = default_config()
    config.mesh.update(data=1, fsdp=-1)
    config.mesh.dcn.data = 2
    ici, dcn = resolve_mesh_shape(config.mesh, 8, num_slices=2)
    assert ici["fsdp"] == 4 and dcn["data"] == 2


def test_unknown_key():
    config = default_config()
    config.train.stepz = 3
    expect_error(config, "unknown config key 'train.stepz'")


@pytest.mark.parametrize("overrides,message", [
    (dict(mesh=dict(data=3, fsdp=1)), "multiply to 3 but there are 8 devices"),
    (dict(mesh=dict(data=1, fsdp=1, tensor=8)),
     "'kv_heads' has size 4, not divisible by mesh.tensor=8"),
    (dict(mesh=dict(data=4, fsdp=2), train=dict(batch_size=12)),
     "'batch' has size 12, not divisible by mesh.data=4xmesh.fsdp=2"),
    (dict(mesh=dict(data=2, pipeline=4), model=dict(n_layers=6)),
     "model.n_layers=6 is not divisible by mesh.pipeline x pipeline.repeats = 4 x 1"),
    (dict(mesh=dict(data=4, pipeline=2), sharding=dict(rules=dict(layers=()))),
     "mesh.pipeline=2 needs sharding.rules.layers="),
])
def test_mesh_and_divisibility_mistakes(overrides, message):
    config = default_config()
    for group, values in overrides.items():
        config[group].update(values)
    expect_error(config, message)


def test_microbatches_must_divide_batch():
    config = default_config()
    config.train.microbatches = 5
    expect_error(config, "train.microbatches=5 does not divide train.batch_size=16")


def test_rule_naming_an_unknown_mesh_axis():
    config = default_config()
    config.sharding.rules.embed = ("fdsp",)
    expect_error(config, "names mesh axis 'fdsp'")


def run_cli(*args, cwd=REPO):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxscale.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--config.train.stepz=3"], "bad override"),
    (["--config.optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["--config.train.steps=-1"], "train.steps=-1 must be >= 1"),
    (["--config.mesh.data=3"], "multiply to 3"),
    (["--config.train.microbatches=3"], "does not divide train.batch_size"),
    (["--config=configs/nope.py"], "config file 'configs/nope.py' does not exist"),
    (["--workdir=/proc/jaxscale_cannot_write_here"], "cannot be written"),
])
def test_cli_bad_input_is_one_error_line_and_exit_2(args, message, tmp_path):
    workdir = ["--workdir", str(tmp_path / "run")] if not any("workdir" in a for a in args) else []
    result = run_cli(*args, *workdir)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists() or not os.listdir(tmp_path / "run")


def test_pipeline_with_moe_layers_is_refused():
    config = default_config()
    config.mesh.update(data=4, pipeline=2)
    config.model.moe.update(experts=4, every=1)
    expect_error(config, "mesh.pipeline=2 with MoE layers")


def test_cudnn_attention_in_pipeline_stages_is_refused():
    """JAX's cuDNN attention cannot be batched over the stages' vmap (seen on an H100)."""
    config = default_config()
    config.mesh.update(data=4, pipeline=2)
    config.model.attention = "cudnn"
    expect_error(config, "model.attention='cudnn' cannot run in mesh.pipeline=2 stages")


def test_a_run_config_from_before_the_experts_rule_was_renamed_still_reads(tmp_path):
    """Sampling and export read a run's config.json over today's defaults without validating it:
    a `sharding.rules.expert` saved before the logical axis became `experts` is carried along
    unused, and the experts keep the default rule."""
    from jaxscale.runtime.workdir import CONFIG_FILE, read_config

    (tmp_path / CONFIG_FILE).write_text('{"sharding": {"rules": {"expert": ["expert"]}}}')
    assert tuple(read_config(str(tmp_path)).sharding.rules.experts) == ("expert",)


def test_the_schema_has_a_size_for_every_mesh_axis_and_no_other():
    mesh = default_config().mesh
    assert set(MESH_AXES) == set(mesh.dcn.keys()) == set(mesh.keys()) - {"dcn"} - {
        key for key in mesh.keys() if key.startswith("auto")}


def test_the_default_config_names_no_family_and_builds_the_default_one():
    """The schema's `model.name` is "" (config.py names no family); the model it builds is
    models/'s DEFAULT_FAMILY, and a name that is not a family is still refused."""
    from jaxscale.models import DEFAULT_FAMILY, FAMILIES, family
    from jaxscale.models.spec import model_config

    config = default_config()
    assert config.model.name == "" and DEFAULT_FAMILY in FAMILIES
    assert model_config(config).family == DEFAULT_FAMILY == family("").name
    config.model.name = "gpt"
    with pytest.raises(ConfigError, match="model.name='gpt' is unknown"):
        validate(config, 1)
