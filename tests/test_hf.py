"""Hugging Face Llama import and export (jaxscale.hf, jaxscale.export_hf, configs/hf.py) and
accurate RoPE, against transformers' own numbers.

The imported logits are checked against tests/fixtures/hf_logits.npz, which
tests/fixtures/make_hf_fixtures.py made with transformers from the tiny folders beside it, so
those tests run without torch. The tests that load an export with transformers itself need torch
and skip only where it is absent: the Python 3.12 CI venv (the `test` extra installs torch's CPU
build on Python 3.11 only).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxscale import hf
from jaxscale.config import default_config
from jaxscale.errors import JaxscaleError
from jaxscale.hf.config import hf_config, model_section
from jaxscale.models.rope import rotation
from jaxscale.models.spec import abstract_model, model_config
from jaxscale.parallel.mesh import build_mesh
from jaxscale.parallel.sharding import use_rules
from tests.helpers import relative_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
TIED, UNTIED = os.path.join(FIXTURES, "hf_tied"), os.path.join(FIXTURES, "hf_untied")
REFERENCE = np.load(os.path.join(FIXTURES, "hf_logits.npz"))


def params_of(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def logits_of(model, cfg) -> np.ndarray:
    out = model(jnp.asarray(REFERENCE["tokens"]), jnp.asarray(REFERENCE["positions"]))
    return np.asarray(out)[..., :cfg.vocab_size]


# -- RoPE --------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [0, 8000, 100_000, 5_000_000])
def test_rotation_is_accurate_at_long_positions(start):
    """cos/sin of position * frequency against float64, with the frequencies written here. The
    float32 product (transformers' way) is off by ~4e-4 at position 8000 and ~6e-3 at 100k."""
    positions = start + np.arange(64)
    freqs = 500000.0 ** (-np.arange(32, dtype=np.float64) / 32)  # head_dim 64
    angles = positions[:, None].astype(np.float64) * freqs
    cos, sin = rotation(jnp.asarray(positions)[None], 64, 500000.0)
    np.testing.assert_allclose(np.asarray(cos[0]), np.cos(angles), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin[0]), np.sin(angles), rtol=0, atol=1e-6)


# -- import ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,path", [("tied", TIED), ("untied", UNTIED)])
def test_imported_logits_equal_transformers(name, path):
    """GQA, llama3 RoPE scaling (both config.json forms), tied and untied, one file and an
    indexed set of shards: logits equal transformers' to 1e-4 relative."""
    model, cfg = hf.load_model(path, compute_dtype="float32")
    assert (cfg.tie_embeddings, cfg.n_heads, cfg.n_kv_heads) == (name == "tied", 4, 2)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_seq_len == 256
    assert relative_error(logits_of(model, cfg), REFERENCE[f"{name}_logits"]) < 1e-4
    # The padded vocabulary rows (300 -> 384) are zero; the file's rows are all there.
    embed = params_of(model)["embed"]
    assert embed.shape == (384, 32) and not np.any(embed[300:]) and np.all(np.any(embed[:300], 1))


def test_the_fixture_needs_the_rope_scaling():
    """Without the llama3 frequencies the same weights miss transformers' logits: the logits
    test above can fail on a RoPE mistake."""
    model, cfg = hf.load_model(TIED, compute_dtype="float32")
    plain = dataclasses.replace(cfg, rope_scaling=None)
    unscaled = nnx.merge(nnx.graphdef(abstract_model(plain)), nnx.state(model))
    assert relative_error(logits_of(unscaled, plain), REFERENCE["tied_logits"]) > 1e-3


def test_sharded_import_equals_one_device():
    """fsdp=4 x tensor=2: every parameter is born sharded and holds the same bits, and the
    logits are those of the one-device import."""
    mesh = build_mesh(dict(data=1, fsdp=4, tensor=2, pipeline=1),
                      dict(data=1, fsdp=1, tensor=1, pipeline=1), jax.devices())
    rules = dict(batch=("data", "fsdp"), embed=("fsdp",), heads=("tensor",),
                 kv_heads=("tensor",), mlp=("tensor",), vocab=("tensor",))
    one, cfg = hf.load_model(UNTIED, compute_dtype="float32")
    sharded, _ = hf.load_model(UNTIED, compute_dtype="float32", mesh=mesh, rules=rules)
    q = params_of(sharded)["blocks"]["attn"]["q"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 8, 2, 8)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params_of(one), params_of(sharded))

    @jax.jit
    def forward(params, tokens, positions):
        with use_rules(mesh, rules):
            return nnx.merge(nnx.graphdef(sharded), params)(tokens, positions)

    got = np.asarray(forward(nnx.state(sharded), jnp.asarray(REFERENCE["tokens"]),
                             jnp.asarray(REFERENCE["positions"])))[..., :cfg.vocab_size]
    # The same parameters; only the order of the sharded sums differs.
    assert relative_error(got, logits_of(one, cfg)) < 1e-5


# -- export ----------------------------------------------------------------------------------

def test_export_then_import_is_bitwise(tmp_path):
    """float32 out and in again: the same bits, sharded files with an index, config.json fields
    as the model's; bfloat16 files hold the parameters rounded to bfloat16."""
    model, cfg = hf.load_model(UNTIED)
    files = hf.save_model(model, cfg, str(tmp_path / "f32"), "float32", shard_bytes=30_000,
                          bos_token_id=298, eos_token_id=299)
    assert len(files) > 1 and os.path.isfile(tmp_path / "f32" / "model.safetensors.index.json")
    again, cfg_again = hf.load_model(str(tmp_path / "f32"))
    assert cfg_again == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params_of(model), params_of(again))
    exported = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert model_section(str(tmp_path / "f32")) == model_section(UNTIED)
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (298, 299)

    hf.save_model(model, cfg, str(tmp_path / "bf16"), "bfloat16")
    assert sorted(os.listdir(tmp_path / "bf16")) == ["config.json", "model.safetensors"]
    halved, _ = hf.load_model(str(tmp_path / "bf16"))
    q = params_of(model)["blocks"]["attn"]["q"]
    np.testing.assert_array_equal(
        np.asarray(params_of(halved)["blocks"]["attn"]["q"]),
        np.asarray(q).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_export_loads_in_transformers_and_back_bitwise(tmp_path):
    """Needs torch and transformers (installed by the `test` extra on Python 3.11; skipped only
    on the Python 3.12 CI venv, which has no CPU torch): our float32 export loads as
    LlamaForCausalLM with no missing or unexpected weights and gives transformers' reference
    logits; transformers' own save of it imports back bit for bit, config fields included."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, cfg = hf.load_model(TIED)
    hf.save_model(model, cfg, str(tmp_path / "ours"), "float32")
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path / "ours"), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    reference = transformers.AutoConfig.from_pretrained(TIED)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "rope_parameters"):
        assert getattr(loaded.config, key) == getattr(reference, key), key
    loaded.config._attn_implementation = "eager"
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor(REFERENCE["tokens"]),
                        position_ids=torch.tensor(REFERENCE["positions"])).logits.numpy()
    assert relative_error(logits, REFERENCE["tied_logits"]) < 1e-5
    loaded.save_pretrained(str(tmp_path / "theirs"))
    back, cfg_back = hf.load_model(str(tmp_path / "theirs"))
    assert cfg_back == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params_of(model), params_of(back))


def test_a_window_the_familys_config_json_has_no_key_for_is_refused_on_export():
    """A Llama trained with a sliding window would load in transformers attending to every
    token: its export is refused rather than written as another model."""
    config = default_config()
    config.model.sliding_window = 8
    with pytest.raises(JaxscaleError, match="sliding_window=8 has no place in a llama config"):
        hf_config(model_config(config), "float32")


# -- bad folders -------------------------------------------------------------------------------

def broken_copy(tmp_path, source, *, config=None, remove=()):
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        data.update(config)
        (folder / "config.json").write_text(json.dumps(data))
    for name in remove:
        os.remove(folder / name)
    return str(folder)


@pytest.mark.parametrize("source,change,names", [
    (TIED, dict(remove=["config.json"]), ["config.json"]),
    (TIED, dict(config=dict(model_type="phi3", architectures=["Phi3ForCausalLM"])),
     ["phi3", "llama"]),
    (TIED, dict(config=dict(intermediate_size=48)),
     ["model.layers.0.mlp.gate_proj.weight", "[64, 32]", "[48, 32]"]),
    (TIED, dict(config=dict(tie_word_embeddings=False)), ["lm_head.weight"]),
    (UNTIED, dict(remove=["model-00002-of-00002.safetensors"]),
     ["model-00002-of-00002.safetensors", "missing"]),
    (TIED, dict(config=dict(rope_scaling=dict(rope_type="yarn", factor=4.0))), ["yarn"]),
])
def test_a_bad_folder_is_named(tmp_path, source, change, names):
    with pytest.raises(JaxscaleError) as raised:
        hf.load_model(broken_copy(tmp_path, source, **change))
    message = str(raised.value)
    assert "\n" not in message and all(name in message for name in names), message


def test_save_refuses_a_folder_in_use_and_writes_nothing(tmp_path):
    model, cfg = hf.load_model(TIED)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine\n")
    with pytest.raises(JaxscaleError, match="not an empty folder"):
        hf.save_model(model, cfg, str(tmp_path / "out"))
    with pytest.raises(JaxscaleError, match="blocks/attn/q"):
        hf.save_model(model, dataclasses.replace(cfg, n_heads=2), str(tmp_path / "other"))
    assert os.listdir(tmp_path / "out") == ["notes.txt"] and not (tmp_path / "other").exists()


# -- training from a Hugging Face folder, and exporting the run --------------------------------

@pytest.mark.slow
def test_fine_tune_from_hf_folder_then_export(tmp_path, capsys):
    """configs/hf.py:FOLDER takes the model section and the tokenizer from the folder and starts
    from its weights (params only, step 0); export_hf writes the run's parameters back. With a
    learning rate too small to move a float32 weight, the export is the folder's weights, bit
    for bit; the chat template beside the tokenizer goes with it."""
    from jaxscale import export_hf
    from jaxscale.cli import load_config_file
    from jaxscale.trainer import Trainer

    folder = str(tmp_path / "model")
    shutil.copytree(TIED, folder)
    template = {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(template, f)
    config = load_config_file(os.path.join(REPO, "configs", "hf.py") + ":" + folder)
    assert (config.model.d_model, config.model.tie_embeddings, config.model.rope_scaling.type,
            config.data.bos_token, config.checkpoint.restore_from) == (
        32, True, "llama3", "<|begin_of_text|>", folder)
    config.train.update(steps=2, batch_size=8, seq_len=16, eval_every=0, log_every=1)
    config.optim.update(lr=1e-30, warmup_steps=0)
    config.precision.compute_dtype = "float32"
    config.checkpoint.update(every_steps=2, compilation_cache=False)
    config.data.sources = (dict(format="synthetic"),)
    workdir = str(tmp_path / "run")
    metrics = Trainer(config, workdir).run()
    assert np.isfinite(metrics["loss"])
    assert "(params only)" in capsys.readouterr().out

    export_hf.main([f"--workdir={workdir}", f"--out={tmp_path / 'out'}", "--dtype=float32"])
    assert "exported step 2" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]
    with open(tmp_path / "out" / "tokenizer_config.json", encoding="utf-8") as f:
        assert json.load(f) == template
    exported, _ = hf.load_model(str(tmp_path / "out"))
    original, _ = hf.load_model(TIED)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params_of(original), params_of(exported))


def test_the_docs_load_an_export_with_the_class_its_config_names():
    """transformers' LlamaForCausalLM loads a Qwen3 folder with a warning only, dropping q_norm
    and k_norm: the docs load an export with AutoModelForCausalLM, which reads config.json's
    architecture. Pasted output (a fence with no language) is exempt: export_hf names the
    family's own class."""
    wrong = []
    for doc in [os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "*.md"))]:
        fence = None  # the open fence's language ("" for pasted output), None outside
        with open(doc, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip().startswith("```"):
                    fence = line.strip()[3:] if fence is None else None
                elif fence != "" and re.search(r"\b(?!Auto)\w+ForCausalLM\.from_pretrained", line):
                    wrong.append(f"{os.path.relpath(doc, REPO)}:{number}: {line.strip()}")
    assert not wrong, "\n".join(wrong)

