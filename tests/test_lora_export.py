"""Exporting a LoRA run (issue 27, item 2): `export_hf` merges the adapters into the weights of
their base, and `--adapters_only` writes them as a PEFT folder (jaxscale/hf/peft.py).

A LoRA run of configs/hf.py on the tied fixture folder (rank 4, alpha 8: the adapters' scale is
2, so an export that ignored alpha, or took alpha for the scale, would be off) trains 2 float32
steps at a learning rate that moves B well off zero. The adapted model -- the base and the
adapters run by jaxscale's own layers, x W + (alpha / r) (x A) B -- is the reference:

- the merged export, loaded back by jaxscale (and by transformers where torch is installed),
  gives its logits;
- the PEFT folder holds (alpha / r) B A = the merged export's weights minus the base's, tensor
  by tensor in Hugging Face's [out, in] layout (read with numpy: no torch needed), and where
  `peft` is installed, `PeftModel.from_pretrained(base, folder)` gives its logits;
- a run without restore_from trained on the init of train.seed: the merged export rebuilds that
  init (slow: a second run).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxscale import export_hf, hf
from jaxscale.config import default_config
from jaxscale.hf import safetensors
from jaxscale.models.lora import join_adapters
from tests.helpers import small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
TIED = os.path.join(FIXTURES, "hf_tied")
REFERENCE = np.load(os.path.join(FIXTURES, "hf_logits.npz"))
TOKENS, POSITIONS = REFERENCE["tokens"], REFERENCE["positions"]
RANK, ALPHA = 4, 8.0
DROPOUT = 0.05  # the run trains with it; an export (like eval) never applies it
TOLERANCE = 1e-5  # relative to the largest logit: float32 sums in another order


def relative_error(got, want) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(want).max())


def train_lora(config, workdir: str) -> None:
    """Two float32 steps of `config` with LoRA (rank 4, alpha 8, dropout 0.05, every target) at
    lr 1e-2."""
    from jaxscale.trainer import Trainer

    config.model.lora.update(rank=RANK, alpha=ALPHA, dropout=DROPOUT)
    config.train.update(steps=2, batch_size=8, seq_len=16, eval_every=0, log_every=1)
    config.optim.update(lr=1e-2, warmup_steps=0)
    config.precision.compute_dtype = "float32"
    config.checkpoint.update(every_steps=2, compilation_cache=False)
    config.data.sources = (dict(format="synthetic"),)
    assert np.isfinite(Trainer(config, workdir).run()["loss"])


def restored_adapters(config, workdir: str) -> dict:
    """The adapters of the run's newest checkpoint, on the first device."""
    from jax.sharding import SingleDeviceSharding

    from jaxscale.checkpoint import restore_params
    from jaxscale.models.spec import model_spec

    spec = model_spec(config)
    device = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                            spec.trained(spec.abstract_params))
    return restore_params(workdir, abstract, spec.config).params


def adapted_logits(config, base: dict, adapters: dict) -> np.ndarray:
    """The logits of the base with the adapters beside it, run by jaxscale's layers."""
    from jaxscale.models.spec import model_spec

    spec = model_spec(config)
    params = jax.device_put(join_adapters(adapters, base), jax.devices()[0])
    model = nnx.merge(spec.graphdef, params)
    logits = model(jnp.asarray(TOKENS), jnp.asarray(POSITIONS))
    return np.asarray(logits)[..., :spec.config.vocab_size]


def logits_of_folder(path: str) -> np.ndarray:
    model, cfg = hf.load_model(path, dtype="float32", compute_dtype="float32")
    return np.asarray(model(jnp.asarray(TOKENS), jnp.asarray(POSITIONS)))[..., :cfg.vocab_size]


def params_of(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def scaled_by(adapters: dict, factor: float) -> dict:
    """The adapters with every B times `factor`: what another scale than alpha / r would merge."""
    return {k: (dict(v, b=v["b"] * factor) if k.endswith("_lora") else scaled_by(v, factor))
            for k, v in adapters.items()}


@pytest.fixture(scope="module")
def hf_lora_run(tmp_path_factory):
    """(config, workdir, adapters, adapted logits) of a LoRA run on the tied fixture folder."""
    from jaxscale.cli import load_config_file

    config = load_config_file(os.path.join(REPO, "configs", "hf.py") + ":" + TIED)
    workdir = str(tmp_path_factory.mktemp("lora") / "run")
    train_lora(config, workdir)
    adapters = restored_adapters(config, workdir)
    base, _ = hf.load_model(TIED, dtype="float32", compute_dtype="float32")
    return config, workdir, adapters, adapted_logits(config, params_of(base), adapters)


def export(capsys, workdir, out, *flags) -> str:
    export_hf.main([f"--workdir={workdir}", f"--out={out}", "--dtype=float32", *flags])
    return capsys.readouterr().out


def test_merged_export_gives_the_adapted_models_logits(hf_lora_run, tmp_path, capsys):
    config, workdir, adapters, adapted = hf_lora_run
    b = [np.abs(np.asarray(a["b"])).max() for a in jax.tree.leaves(
        adapters, is_leaf=lambda x: isinstance(x, dict) and "b" in x)]
    assert len(b) == 7 and min(b) > 1e-3  # every target trained: B is off zero
    line = export(capsys, workdir, tmp_path / "merged")
    assert "exported step 2" in line and "LoRA" in line and TIED in line, line
    assert sorted(os.listdir(tmp_path / "merged")) == ["config.json", "model.safetensors",
                                                       "tokenizer.json"]
    merged = logits_of_folder(str(tmp_path / "merged"))
    assert relative_error(merged, adapted) < TOLERANCE
    # The test can fail: the base alone, or adapters scaled by 1 instead of alpha / r = 2, are off
    # by far more than the tolerance.
    assert relative_error(merged, logits_of_folder(TIED)) > 100 * TOLERANCE
    base, _ = hf.load_model(TIED, dtype="float32", compute_dtype="float32")
    unscaled = adapted_logits(config, params_of(base), scaled_by(adapters, RANK / ALPHA))
    assert relative_error(merged, unscaled) > 100 * TOLERANCE


@pytest.mark.slow  # torch and transformers load in seconds; CI runs it
def test_merged_export_loads_in_transformers(hf_lora_run, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, workdir, _, adapted = hf_lora_run
    export(capsys, workdir, tmp_path / "merged")
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    assert relative_error(torch_logits(torch, model), adapted) < TOLERANCE


def torch_logits(torch, model) -> np.ndarray:
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=torch.tensor(TOKENS),
                     position_ids=torch.tensor(POSITIONS)).logits.numpy()


def read_tensors(path: str) -> dict[str, np.ndarray]:
    return {name: safetensors.read_slice(info, info.shape, tuple(slice(None) for _ in info.shape))
            for name, info in safetensors.read_header(path).items()}


def test_peft_folder_holds_the_merged_change(hf_lora_run, tmp_path, capsys):
    """Without torch: the PEFT tensors' (lora_alpha / r) B A is the merged export's weight minus
    the base's, for every targeted module of every layer."""
    _, workdir, _, _ = hf_lora_run
    line = export(capsys, workdir, tmp_path / "peft", "--adapters_only")
    assert "adapters" in line and "PeftModel.from_pretrained" in line, line
    assert sorted(os.listdir(tmp_path / "peft")) == ["adapter_config.json",
                                                     "adapter_model.safetensors", "tokenizer.json"]
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert (peft_config["peft_type"], peft_config["task_type"], peft_config["r"],
            peft_config["lora_alpha"], peft_config["target_modules"],
            peft_config["base_model_name_or_path"], peft_config["lora_dropout"]) == (
                "LORA", "CAUSAL_LM", RANK, ALPHA, modules, TIED, DROPOUT)
    export(capsys, workdir, tmp_path / "merged")
    lora = read_tensors(str(tmp_path / "peft" / "adapter_model.safetensors"))
    merged = read_tensors(str(tmp_path / "merged" / "model.safetensors"))
    base = read_tensors(os.path.join(TIED, "model.safetensors"))
    assert len(lora) == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    for layer in range(2):
        for module in modules:
            part = "self_attn" if module[0] in "qkvo" else "mlp"
            name = f"model.layers.{layer}.{part}.{module}"
            a = lora[f"base_model.model.{name}.lora_A.weight"]
            b = lora[f"base_model.model.{name}.lora_B.weight"]
            assert a.shape[0] == b.shape[1] == RANK
            change = merged[f"{name}.weight"] - base[f"{name}.weight"].astype(np.float32)
            np.testing.assert_allclose(ALPHA / RANK * b @ a, change, atol=2e-6,
                                       err_msg=name)


@pytest.mark.slow  # torch and transformers load in seconds; CI runs it
def test_peft_loads_the_adapters_onto_the_base(hf_lora_run, tmp_path, capsys):
    """Needs torch, transformers and peft: PeftModel.from_pretrained(the base, the folder) gives
    the adapted model's logits, and loads every adapter tensor (none missing, none unused)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    _, workdir, _, adapted = hf_lora_run
    export(capsys, workdir, tmp_path / "peft", "--adapters_only")
    base = transformers.LlamaForCausalLM.from_pretrained(TIED, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft"))
    lora_a = [n for n, _ in model.named_parameters() if "lora_A" in n]
    assert len(lora_a) == 7 * 2
    assert relative_error(torch_logits(torch, model), adapted) < TOLERANCE
    # What peft loaded is what was written: its state dict round-trips the file.
    written = read_tensors(str(tmp_path / "peft" / "adapter_model.safetensors"))
    loaded = peft.get_peft_model_state_dict(model)
    assert sorted(loaded) == sorted(written)
    for name, tensor in loaded.items():
        np.testing.assert_array_equal(tensor.numpy(), written[name], err_msg=name)


# -- bad input: one error line, exit 2, nothing written ----------------------------------------

def saved_config(tmp_path, **sections) -> str:
    """A workdir holding only config.json: the defaults with `sections` updated."""
    config = default_config()
    for section, values in sections.items():
        config[section].update(values)
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "config.json").write_text(config.to_json_best_effort())
    return str(workdir)


@pytest.mark.parametrize("case,names", [
    ("no LoRA", ["--adapters_only", "model.lora.rank=0"]),
    ("an init base", ["--adapters_only", "train.seed=0", "without --adapters_only"]),
    ("a base that is gone", ["checkpoint.restore_from", "gone"]),
])
def test_bad_exports_are_one_error_line_and_write_nothing(case, names, tmp_path, capsys,
                                                          hf_lora_run):
    flags = ["--adapters_only"]
    if case == "no LoRA":
        workdir = saved_config(tmp_path)
    elif case == "an init base":
        workdir = saved_config(tmp_path, model=dict(lora=dict(rank=RANK)))
    else:  # the run's checkpoint, its config naming a base folder that is not there any more
        workdir = str(tmp_path / "run")
        shutil.copytree(hf_lora_run[1], workdir)
        saved = json.loads(open(os.path.join(workdir, "config.json")).read())
        saved["checkpoint"]["restore_from"] = str(tmp_path / "gone")
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(saved, f)
        flags = []
    with pytest.raises(SystemExit) as exited:
        export_hf.main([f"--workdir={workdir}", f"--out={tmp_path / 'out'}", *flags])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert all(name in err for name in names), err
    assert not (tmp_path / "out").exists()


# -- a base that is the init of train.seed ------------------------------------------------------

@pytest.mark.slow
def test_merged_export_of_a_run_on_the_init(tmp_path, capsys):
    """Without checkpoint.restore_from the adapters trained on the init of train.seed (with the
    adapters in its random stream): the merged export rebuilds it, and gives the adapted model's
    logits with the trainer's own init as the base."""
    from jaxscale.trainer import Trainer

    config = small_config(data=-1)
    config.model.update(vocab_size=300)
    config.train.seed = 3
    workdir = str(tmp_path / "run")
    train_lora(config, workdir)
    line = export(capsys, workdir, tmp_path / "merged")
    assert "the init of train.seed=3" in line, line
    init_state = Trainer(config, str(tmp_path / "again")).program.init_state
    adapters = restored_adapters(config, workdir)
    merged = logits_of_folder(str(tmp_path / "merged"))
    adapted = adapted_logits(config, jax.device_get(init_state(3).frozen), adapters)
    assert relative_error(merged, adapted) < TOLERANCE
    other_seed = adapted_logits(config, jax.device_get(init_state(4).frozen), adapters)
    assert relative_error(merged, other_seed) > 100 * TOLERANCE
