"""LoRA on a mixture of experts (jaxscale/models/lora.py, jaxscale/models/moe.py): adapters on
the attention projections and one per expert on the stacked expert weights. At step 0 the
adapted model is the base; the step's gradients are those of the merged weights; only the
adapters train; `lora.merged` is W + (alpha / r) A B expert by expert; dropout on the experts'
adapters is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.errors import ConfigError
from jaxscale.models import lora
from jaxscale.models.spec import model_spec
from jaxscale.training.step import Objective, Weights
from tests.helpers import one_line_error, random_batch, small_config
from tests.test_lora import assert_only_the_adapters_train, program_for, steps_on, with_nonzero_b

EXPERTS = 4
ALL_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def moe_config(rank=4, capacity_factor=0.0, **mesh):
    """A 2-layer Mixtral, every layer MoE, with adapters on attention and experts."""
    c = small_config(**mesh)
    c.model.name = "mixtral"
    c.model.moe.update(experts=EXPERTS, top_k=2, every=1, capacity_factor=capacity_factor)
    c.model.lora.update(rank=rank, alpha=8.0, targets=ALL_TARGETS)
    return c


def base_of(config):
    c = config.copy_and_resolve_references()
    c.model.lora.rank = 0
    return c


def mlp(tree):
    return tree["blocks"]["layers"][0]["mlp"]


def test_each_expert_has_its_adapter_on_the_experts_axis():
    spec = model_spec(moe_config())
    adapters = spec.trained(spec.logical_specs)
    experts = mlp(adapters)
    assert set(experts) == {"gate_lora", "up_lora", "down_lora"}  # not the router
    assert tuple(experts["gate_lora"]["a"]) == ("layers", "experts", "embed", None)
    assert tuple(experts["gate_lora"]["b"]) == ("layers", "experts", None, "mlp")
    assert tuple(experts["down_lora"]["a"]) == ("layers", "experts", "mlp", None)
    shapes = mlp(spec.trained(spec.abstract_params))
    assert shapes["up_lora"]["a"].shape == (2, EXPERTS, 64, 4)
    assert shapes["up_lora"]["b"].shape == (2, EXPERTS, 4, 128)
    assert set(adapters["blocks"]["layers"][0]["attn"]) == {f"{t}_lora" for t in "qkvo"}


@pytest.mark.parametrize("capacity_factor", [
    0.0, pytest.param(1.25, marks=pytest.mark.slow)], ids=["dropless", "capacity"])
def test_at_step_zero_the_adapted_model_is_the_base_model(capacity_factor):
    config = moe_config(capacity_factor=capacity_factor)
    state = program_for(config).init_state(0)
    batch = random_batch(config)
    adapted = program_for(config).eval_step(state.model_params(), batch)
    base = program_for(base_of(config)).eval_step(state.frozen, batch)
    np.testing.assert_array_equal(np.asarray(adapted[0]), np.asarray(base[0]))
    # ... and B is what makes it so: a nonzero B on the experts alone changes the loss.
    experts_only = jax.device_get(state.params)
    for name in ("gate_lora", "up_lora", "down_lora"):
        mlp(experts_only)[name] = with_nonzero_b(mlp(experts_only)[name])
    moved = program_for(config).eval_step(lora.join_adapters(experts_only, state.frozen), batch)
    assert abs(float(moved[0]) - float(base[0])) > 1e-3


def test_merged_adds_each_experts_own_low_rank_change():
    """`lora.merged` against numpy: expert e of layer l gets W[l, e] + s A[l, e] B[l, e]."""
    config = moe_config()
    state = program_for(config).init_state(0)
    adapters = with_nonzero_b(jax.device_get(state.params))
    weights = lora.merged(lora.join_adapters(adapters, jax.device_get(state.frozen)),
                          program_for(config).model.config.lora)
    scale = 8.0 / 4
    for name in ("gate", "up", "down"):
        a, b = (np.asarray(mlp(adapters)[f"{name}_lora"][k], np.float64) for k in "ab")
        base = np.asarray(mlp(jax.device_get(state.frozen))[name], np.float64)
        want = base + scale * np.einsum("ledr,lerf->ledf", a, b)
        np.testing.assert_allclose(np.asarray(mlp(weights)[name]), want, rtol=1e-6, atol=1e-6)
        assert f"{name}_lora" not in mlp(weights)
    q = weights["blocks"]["layers"][0]["attn"]["q"]
    a, b = (np.asarray(adapters["blocks"]["layers"][0]["attn"]["q_lora"][k]) for k in "ab")
    base = np.asarray(jax.device_get(state.frozen)["blocks"]["layers"][0]["attn"]["q"])
    np.testing.assert_allclose(np.asarray(q), base + scale * np.einsum("ldr,lrnh->ldnh", a, b),
                               rtol=1e-5, atol=1e-6)


def decisive_routers(frozen):
    """The base with its routers' weights scaled up: at init the router's probabilities are
    near even, and float32 rounding (adapters run beside their weights or merged) flips top-2
    choices, which moves the gradients by far more than rounding."""
    frozen = jax.tree.map(lambda x: x, frozen)
    mlp(frozen)["router"] = 10 * mlp(frozen)["router"]
    return frozen


@pytest.mark.slow
@pytest.mark.parametrize("capacity_factor", [0.0, 1.25], ids=["dropless", "capacity"])
def test_gradients_equal_those_of_the_merged_weights_in_plain_jax(capacity_factor):
    """The step folds each expert's adapter into its weight in the layer; the reference
    differentiates the base model at the merged weights (`lora.merged`) with plain jax.grad."""
    config = moe_config(capacity_factor=capacity_factor)
    program = program_for(config)
    state = program.init_state(0)
    adapters, frozen = with_nonzero_b(state.params), decisive_routers(state.frozen)
    batch = jax.tree.map(jnp.asarray, random_batch(config))
    tokens = jnp.sum(batch["loss_mask"])
    objective = Objective.of(config, program.model.train_graphdef, None)
    total, grads, _, _ = objective.forward_backward(Weights(adapters, frozen), batch, 1 / tokens)
    base_graphdef = model_spec(base_of(config)).graphdef
    lora_cfg = program.model.config.lora

    base = Objective.of(base_of(config), base_graphdef, None)

    def reference(adapters):  # the summed loss and the routers' penalty, as the step takes them
        weights = lora.merged(lora.join_adapters(adapters, frozen), lora_cfg)
        total, count, router = base.summed_loss(Weights(weights), batch)
        return (total + base.router_penalty(router, count)) / tokens
    loss, expected = jax.value_and_grad(reference)(adapters)
    assert float(total / tokens) < float(loss)  # the penalty is in the objective
    jax.tree.map(lambda g, e: np.testing.assert_allclose(np.asarray(g), np.asarray(e),
                                                         rtol=2e-4, atol=1e-7), grads, expected)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.slow  # 3 steps of a LoRA mixture (about 12 s)
def test_only_the_adapters_train_and_only_they_have_optimizer_state():
    assert_only_the_adapters_train(moe_config())


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [dict(expert=4, data=2), dict(fsdp=4, tensor=2)],
                         ids=["expert-data", "fsdp-tensor"])
def test_a_sharded_mesh_trains_the_adapters_as_one_device_does(mesh):
    """The experts' adapters split with their experts (expert=4: a device holds one expert's
    weights and adapters) or over fsdp and tensor: one device's losses and adapters."""
    for name in ("gate_lora", "down_lora"):  # both factors follow the experts' split
        for factor in mlp(program_for(moe_config(**mesh)).state_shardings.params)[name].values():
            assert factor.spec[1] in ("expert", ("expert", "fsdp")), factor.spec
    losses, adapters = steps_on(moe_config(**mesh))
    one_losses, one_adapters = steps_on(moe_config())
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 adapters, one_adapters)


def test_dropout_on_the_experts_adapters_is_refused():
    from jaxscale.models.lora import check_lora
    config = moe_config()
    config.model.lora.dropout = 0.1
    message = one_line_error(ConfigError, lambda: check_lora(config))
    assert "model.lora.dropout=0.1" in message and "'gate'" in message
    config.model.lora.targets = ("q", "v")  # attention's adapters take dropout
    check_lora(config)


def test_a_peft_config_puts_the_experts_adapters_on_the_fused_parameters():
    """transformers' Mixtral holds a layer's experts as fused parameters: the experts' adapters
    go to PEFT's `target_parameters`, gate and up as one adapter of twice the rank and alpha on
    gate_up_proj; attention's sit on its modules."""
    from jaxscale.hf import peft
    cfg = model_spec(moe_config()).config
    peft_config = peft.adapter_config(cfg, None)
    assert peft_config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert peft_config["target_parameters"] == ["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"]
    assert (peft_config["r"], peft_config["lora_alpha"]) == (4, 8)
    assert peft_config["rank_pattern"] == {"experts.gate_up_proj": 8}
    assert peft_config["alpha_pattern"] == {"experts.gate_up_proj": 16}
    config = moe_config()
    config.model.lora.targets = ("q", "v", "up")
    peft_config = peft.adapter_config(model_spec(config).config, None)
    assert peft_config["target_parameters"] == ["mlp.experts.gate_up_proj"]
    assert peft_config["rank_pattern"] == {}


def test_experts_adapters_of_another_rank_are_refused_by_name(tmp_path):
    """The experts' factors are checked against the model config as attention's are: rank-4
    adapters with a rank-8 config name the expert weight and both shapes; nothing is written."""
    from jaxscale.errors import JaxscaleError
    from jaxscale.hf import peft
    spec = model_spec(moe_config(rank=4))
    adapters = spec.trained(spec.abstract_params)
    config = moe_config(rank=8)
    config.model.lora.targets = ("gate",)
    message = one_line_error(JaxscaleError, lambda: peft.save_adapters(
        adapters, model_spec(config).config, str(tmp_path / "lora")))
    assert f"blocks/layers/0/mlp/gate_lora is a [2, {EXPERTS}, 64, 4]" in message
    assert f"needs a [2, {EXPERTS}, 64, 8]" in message and not (tmp_path / "lora").exists()


def adapted_mixtral(config):
    """A Mixtral with trained-like adapters (nonzero B) and decisive routers: (its config,
    params, tokens, the logits jaxscale's adapted model gives, the base's config)."""
    from flax import nnx

    from jaxscale.models.spec import create_model

    config.model.vocab_multiple = 1
    cfg = model_spec(config).config
    graphdef, state = nnx.split(create_model(cfg, 0))
    adapters, frozen = lora.split_adapters(nnx.to_pure_dict(state))
    params = lora.join_adapters(with_nonzero_b(adapters), decisive_routers(frozen))
    nnx.replace_by_pure_dict(state, params)
    tokens = jnp.asarray(random_batch(config)["inputs"][:2])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    adapted = np.asarray(nnx.merge(graphdef, state)(tokens, positions))
    return cfg, params, tokens, adapted, model_spec(base_of(config)).config


def transformers_logits(torch, model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.mark.slow
@pytest.mark.parametrize("family, targets", [("mixtral", ALL_TARGETS),
                                             ("qwen3_moe", ("k", "up", "down"))])
def test_peft_loads_the_experts_adapters_with_the_adapted_logits(tmp_path, family, targets):
    """A mixture's base exported by hf.save_model and its adapters by peft.save_adapters give (a
    Mixtral with adapters everywhere, a Qwen3-MoE with up's but not gate's), loaded by
    transformers and PeftModel.from_pretrained (float32), the logits jaxscale's adapted model
    gives (1e-5 of the largest); with the adapters off, the base's, which are far off."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft_library = pytest.importorskip("peft")
    from flax import nnx

    from jaxscale import hf
    from jaxscale.hf import peft
    from jaxscale.models.spec import spec_of
    from tests.helpers import relative_error

    config = moe_config()
    config.model.name, config.model.lora.targets = family, targets
    cfg, params, tokens, adapted, base_cfg = adapted_mixtral(config)
    adapters, frozen = lora.split_adapters(params)
    hf.save_model(nnx.merge(spec_of(base_cfg).graphdef, frozen), base_cfg, str(tmp_path / "m"),
                  "float32")
    peft.save_adapters(adapters, cfg, str(tmp_path / "lora"), "float32")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "m"), dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager")
    model = peft_library.PeftModel.from_pretrained(base, str(tmp_path / "lora"))
    assert relative_error(transformers_logits(torch, model, tokens), adapted) < 1e-5
    with model.disable_adapter():
        assert relative_error(transformers_logits(torch, model, tokens), adapted) > 1e-3


@pytest.mark.slow
def test_merged_export_loads_in_transformers_with_the_adapted_logits(tmp_path):
    """A Mixtral with trained-like adapters on attention and every expert, merged (`lora.merged`)
    and exported by hf.save_model, gives in transformers (float64) the logits jaxscale's adapted
    model gives with the adapters beside the weights; the base alone is off by far more."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from flax import nnx

    from jaxscale import hf
    from jaxscale.models.spec import spec_of
    from tests.helpers import relative_error

    cfg, params, tokens, adapted, base_cfg = adapted_mixtral(moe_config())
    merged = lora.merged(params, cfg.lora)
    hf.save_model(nnx.merge(spec_of(base_cfg).graphdef, merged), base_cfg, str(tmp_path / "m"),
                  "float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "m"), dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager")
    assert relative_error(transformers_logits(torch, model, tokens), adapted) < 1e-5
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    base = nnx.merge(spec_of(base_cfg).graphdef, lora.split_adapters(params)[1])
    assert relative_error(np.asarray(base(tokens, positions)), adapted) > 1e-3
