"""The sampler (jaxscale/sample.py) and the model's KV-cache path: cached logits equal the full
forward pass's, greedy sampling is the step-by-step argmax of the full forward pass, a sharded
mesh samples what one device samples, the padded vocabulary is never drawn, top-p keeps exactly
the nucleus, seeds decide the text, and `python -m jaxscale.sample` prints a trained run's greedy
continuation."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxscale.config
from jaxscale import hf
from jaxscale.checkpoint import restore_from
from jaxscale.config import MESH_AXES, default_config
from jaxscale.data.tokenizers import ByteTokenizer, tokenizer_from_config
from jaxscale.hf.config import update_config
from jaxscale.inference.sampler import Sampler, next_token, sampling_mesh
from jaxscale.models.llama import LlamaConfig
from jaxscale.models.spec import create_model
from jaxscale.parallel.sharding import rules_from_config
from jaxscale.sample import main as sample_main
from jaxscale.trainer import Trainer
from tests.helpers import jitted, small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 100  # padded to 128: 28 ids no tokenizer makes


def random_model(tie_embeddings=False, n_layers=2, **fields):
    """A float32 GQA model whose parameters are scaled up from the init, so that its logits spread
    as a trained model's do and argmax has no near-ties; `fields`: more of its config's."""
    cfg = LlamaConfig(vocab_size=VOCAB, vocab_multiple=64, d_model=32, n_layers=n_layers,
                      n_heads=4, n_kv_heads=2, head_dim=8, mlp_dim=64,
                      tie_embeddings=tie_embeddings, dtype="float32", max_seq_len=64, **fields)
    graphdef, state = nnx.split(create_model(cfg, 0))
    return nnx.merge(graphdef, jax.tree.map(lambda x: x * 4, state))


def prompts(batch=2, length=5, seed=1):
    return np.random.default_rng(seed).integers(3, VOCAB, size=(batch, length), dtype=np.int32)


@pytest.mark.parametrize("tie", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_kv_cache_logits_equal_the_full_forward_pass_at_every_position(tie):
    model = random_model(tie)
    tokens = prompts(length=12)
    full = jitted(model, "__call__")(tokens)
    decode, logits = jitted(model, "decode"), jitted(model, "logits")
    # Prefill 5, then 3 tokens in one call (a later chunk attends to the cache and to itself),
    # then one at a time; the cache has room to spare, whose slots must stay masked.
    cache = model.init_cache(2, 16)
    got = []
    for begin, end in [(0, 5), (5, 8)] + [(i, i + 1) for i in range(8, 12)]:
        features, cache = decode(tokens[:, begin:end], cache, begin)
        got.append(logits(features))
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got[..., :VOCAB], full[..., :VOCAB], rtol=1e-5, atol=1e-5)
    assert np.all(got[..., VOCAB:] == np.finfo(np.float32).min)


def full_forward_greedy(model, prompt, steps):
    """Greedy decoding without a cache: the whole sequence through the model for every token.
    The rows are padded to their final length once (one compile); attention is causal, so the
    padding after a position does not change its logits."""
    forward = jitted(model, "__call__")
    length = prompt.shape[1]
    tokens = np.zeros((prompt.shape[0], length + steps), np.int32)
    tokens[:, :length] = prompt
    for i in range(length, length + steps):
        tokens[:, i] = forward(tokens)[:, i - 1].argmax(-1)
    return tokens[:, length:]


def test_greedy_sampling_is_the_step_by_step_argmax_of_the_full_forward_pass():
    model, prompt = random_model(), prompts()
    got = Sampler(model).generate(prompt, max_new_tokens=16, temperature=0.0)
    expected = full_forward_greedy(model, prompt, 16)
    np.testing.assert_array_equal(got, expected)
    assert len(np.unique(expected)) > 4  # a real sequence, not one token over and over


@pytest.mark.parametrize("layers", [dict(sliding_window=4),
                                    dict(sliding_window=4, global_every=2, rope_local_theta=100.0)])
def test_a_windowed_layers_cache_keeps_only_its_window_and_samples_the_same(layers):
    """Every layer windowed (Mistral's), or local and global layers alternating (Gemma 3's): the
    windowed layers' cache is a ring of the window's 4 slots, the others' holds every position,
    and greedy sampling 16 tokens past a 5-token prompt (the ring wrapped many times) is the
    argmax of the full forward pass, which has no cache."""
    model, prompt = random_model(n_layers=4, **layers), prompts()
    cache = model.init_cache(2, 20)
    windowed = 2 if "global_every" in layers else 4
    assert (cache.local_k.shape[:3], cache.k.shape[:3]) == ((windowed, 2, 4), (4 - windowed, 2, 20))
    got = Sampler(model).generate(prompt, max_new_tokens=16, temperature=0.0)
    np.testing.assert_array_equal(got, full_forward_greedy(model, prompt, 16))


def test_a_tiny_top_p_is_greedy():
    model, prompt = random_model(), prompts()
    greedy = Sampler(model).generate(prompt, max_new_tokens=16, temperature=0.0)
    nucleus_of_one = Sampler(model).generate(prompt, max_new_tokens=16, temperature=1.0,
                                             top_p=1e-6, seed=3)
    np.testing.assert_array_equal(nucleus_of_one, greedy)


def test_sampling_on_an_fsdp_by_tensor_mesh_equals_one_device():
    model, prompt = random_model(), prompts()
    sizes = dict(fsdp=2, tensor=2)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape([sizes.get(a, 1) for a in MESH_AXES]),
                MESH_AXES)
    sharded = Sampler(model, mesh, rules_from_config(default_config().sharding.rules))
    # The parameters really are split: the head over `fsdp` (embed) and `tensor` (vocab).
    assert sharded.params["head"].sharding.spec == P("fsdp", "tensor")
    single = Sampler(model)
    for settings in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=5)):
        np.testing.assert_array_equal(
            sharded.generate(prompt, max_new_tokens=12, **settings),
            single.generate(prompt, max_new_tokens=12, **settings))


def test_padded_ids_are_never_sampled_even_at_a_huge_temperature():
    model = random_model()
    # At 1e38 the real logits are all ~0 and the padding's float32 minimum only ~-3: without
    # the sampler's own mask, a fifth of the draws would be padding.
    tokens = Sampler(model).generate(prompts(batch=8), max_new_tokens=32, temperature=1e38)
    assert tokens.max() < VOCAB
    assert len(np.unique(tokens)) > 60  # the temperature did flatten the distribution


def test_top_p_samples_exactly_the_nucleus_in_proportion():
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = np.full((4000, 8), np.finfo(np.float32).min, np.float32)  # 4 real ids, 4 padding
    logits[:, :4] = np.log(probs)
    for top_p, nucleus in ((0.7, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3})):
        ids = np.asarray(next_token(jnp.asarray(logits), jax.random.key(0), 1.0, top_p, 4))
        assert set(np.unique(ids)) == nucleus, top_p
        kept = probs[sorted(nucleus)]
        np.testing.assert_allclose(np.bincount(ids, minlength=4)[:len(kept)] / len(ids),
                                   kept / kept.sum(), atol=0.03)


def test_the_same_seed_gives_the_same_text_and_another_seed_other_text():
    model, prompt = random_model(), prompts()
    sampler = Sampler(model)
    def draw(seed):
        return sampler.generate(prompt, max_new_tokens=16, temperature=1.0, seed=seed)
    np.testing.assert_array_equal(draw(7), draw(7))
    assert not np.array_equal(draw(7), draw(8))


def test_the_runs_mesh_is_kept_when_it_fits_these_devices_else_all_go_to_data():
    config = default_config()
    config.mesh.update(data=-1, fsdp=2, tensor=2)
    assert dict(sampling_mesh(config, jax.devices()).shape) == dict(
        data=2, fsdp=2, tensor=2, pipeline=1, expert=1, context=1)
    config.mesh.update(data=1, fsdp=16, tensor=1)  # trained on 16 devices; 8 here
    assert dict(sampling_mesh(config, jax.devices()).shape) == dict(
        data=8, fsdp=1, tensor=1, pipeline=1, expert=1, context=1)


@pytest.fixture(scope="module")
def trained_workdir(tmp_path_factory):
    """A small run trained 2 steps on synthetic tokens, with its checkpoint at step 2."""
    workdir = str(tmp_path_factory.mktemp("sample") / "run")
    config = small_config(data=-1)
    config.train.steps = 2
    config.data.sources = (dict(format="synthetic"),)
    config.checkpoint.compilation_cache = False
    trainer = Trainer(config, workdir)
    trainer.run()
    return workdir, trainer


def test_the_cli_prints_the_greedy_continuation_of_a_trained_run(trained_workdir):
    workdir, trainer = trained_workdir
    prompt = "def main():"
    # The 8 devices of conftest's XLA_FLAGS: the run's mesh, data=8, for a batch of 1 prompt.
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.sample", f"--workdir={workdir}", f"--prompt={prompt}",
         "--max_new_tokens=12", "--temperature=0"],
        cwd=REPO, env=env, capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]

    # Independently: the checkpoint's params, full forward passes, the byte tokenizer by hand.
    restored = restore_from(workdir, trainer.program.abstract_state, params_only=True,
                            model_config=trainer.program.model.config)
    model = nnx.merge(trainer.program.model.graphdef, restored.params)
    tokenizer = ByteTokenizer()
    ids = np.concatenate([[tokenizer.bos_id], tokenizer.encode(prompt)]).astype(np.int32)[None]
    new = full_forward_greedy(model, ids, 12)[0]
    eos = np.flatnonzero(new == tokenizer.eos_id)
    new = new[:eos[0]] if len(eos) else new
    expected = bytes(int(i) - 3 for i in new if i >= 3).decode("utf-8", errors="replace")
    assert result.stdout == expected.encode("utf-8") + b"\n"


def test_the_cli_continues_a_hugging_face_folder_greedily(monkeypatch, capsys):
    """--hf: the folder's model (GQA, tied, llama3 RoPE scaling), its tokenizer.json and BOS; in
    float32 compute, so that the comparison is exact."""
    folder = os.path.join(REPO, "tests", "fixtures", "hf_tied")

    def float32_default_config():
        config = default_config()
        config.precision.compute_dtype = "float32"
        return config

    monkeypatch.setattr(jaxscale.config, "default_config", float32_default_config)
    prompt = "w1 w5 w9 w2"
    sample_main([f"--hf={folder}", f"--prompt={prompt}", "--max_new_tokens=10",
                 "--temperature=0"])

    model, _ = hf.load_model(folder, compute_dtype="float32")
    config = float32_default_config()
    update_config(config, folder, "test")
    tokenizer = tokenizer_from_config(config)
    assert tokenizer.bos_id == 298  # config.json's bos_token_id, put before the prompt
    ids = np.concatenate([[tokenizer.bos_id], tokenizer.encode(prompt)]).astype(np.int32)[None]
    new = full_forward_greedy(model, ids, 10)[0]
    eos = np.flatnonzero(new == tokenizer.eos_id)
    assert capsys.readouterr().out == tokenizer.decode(new[:eos[0]] if len(eos) else new) + "\n"
