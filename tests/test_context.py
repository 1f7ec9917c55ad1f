"""Context parallelism (issue 13): the sequence split over the `context` mesh axis gives the loss
and gradients of the whole sequence on one device, packed or not, alone and with the other axes;
the load-balanced token order round-trips and evens out the causal work; attention all-gathers
the keys and values over the context axis; a run restores across context degrees, and a context
axis across two hosts trains like one host.
"""

import jax
import numpy as np
import pytest

from jaxscale.parallel.context import load_balanced, load_balanced_order
from jaxscale.plan.collectives import replica_groups
from jaxscale.training.step import Objective, Weights
from tests.helpers import (
    loss_and_gradients_on_mesh,
    mesh_trainer,
    random_batch,
    resumable_cli_losses,
    small_config,
)


def context_config(**mesh):
    config = small_config(**mesh)
    config.train.seq_len = 32
    return config


def unpacked_batch(config, seed=0):
    """`random_batch` with one document filling every row: no padding, positions 0..L-1."""
    batch = random_batch(config, seed)
    b, l = batch["inputs"].shape
    batch.update(segment_ids=np.ones((b, l), np.int32), loss_mask=np.ones((b, l), np.float32),
                 positions=np.broadcast_to(np.arange(l, dtype=np.int32), (b, l)).copy())
    return batch


BATCHES = {"packed": random_batch, "unpacked": unpacked_batch}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """jax.grad of the plain model on one device, in the natural token order, per batch kind."""
    config = context_config()
    trainer = mesh_trainer(config, tmp_path_factory.mktemp("ref"))
    params = trainer.program.init_state(config.train.seed).params
    out = {}
    for kind, make_batch in BATCHES.items():
        batch = make_batch(config)

        def mean_loss(p, batch=batch):
            total, tokens, _ = Objective(trainer.program.model.graphdef).summed_loss(
                Weights(p), batch)
            return total / tokens
        out[kind] = jax.device_get(jax.jit(jax.value_and_grad(mean_loss))(params))
    return out


@pytest.mark.parametrize("mesh,kind", [
    # Without the slow ones, both layouts, both degrees and each other axis still run.
    (dict(context=2), "packed"), pytest.param(dict(context=2), "unpacked", marks=pytest.mark.slow),
    pytest.param(dict(context=4), "packed", marks=pytest.mark.slow), (dict(context=4), "unpacked"),
    (dict(context=2, fsdp=2), "packed"),
    pytest.param(dict(context=4, fsdp=2), "unpacked", marks=pytest.mark.slow),
    pytest.param(dict(context=2, tensor=2), "packed", marks=pytest.mark.slow),
    (dict(context=2, data=2, tensor=2), "unpacked"),
], ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items()))
def test_a_split_sequence_gives_the_whole_sequences_loss_and_gradients(mesh, kind, references,
                                                                       tmp_path):
    loss, grads, _ = loss_and_gradients_on_mesh(context_config(**mesh),
                                                tmp_path, BATCHES[kind](context_config()))
    ref_loss, ref_grads = references[kind]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 grads, ref_grads)


@pytest.mark.parametrize("schedule,remat", [
    ("gpipe", "full"), pytest.param("1f1b", "save_dots", marks=pytest.mark.slow)])
def test_context_with_pipeline_stages_and_remat(schedule, remat, references, tmp_path):
    """The attention's shard_map runs inside the pipeline's vmap over stages, and under remat."""
    config = context_config(context=2, pipeline=2)
    config.model.remat = remat
    config.pipeline.schedule = schedule
    loss, grads, _ = loss_and_gradients_on_mesh(config, tmp_path)
    ref_loss, ref_grads = references["packed"]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
                 grads, ref_grads)


@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_the_load_balanced_order_round_trips_and_evens_out_causal_work(shards):
    batch = random_batch(context_config())  # [8, 32], packed
    length = batch["inputs"].shape[1]
    order = load_balanced_order(length, shards)
    assert sorted(order) == list(range(length))
    laid_out = load_balanced(batch, shards)
    for name, array in batch.items():
        np.testing.assert_array_equal(laid_out[name][:, np.argsort(order)], array)
    # Unmasked (query, key) pairs of the causal mask over true positions, per shard's queries.
    def work(positions):
        return [int(np.sum(positions[None, :] <= queries[:, None]))
                for queries in np.split(positions, shards)]
    balanced = work(order)
    assert len(set(balanced)) == 1 and sum(balanced) == length * (length + 1) // 2, balanced
    in_order = work(np.arange(length))
    assert shards == 1 or max(in_order) > min(in_order)  # what the order fixes


def test_attention_all_gathers_keys_and_values_over_the_context_axis(tmp_path):
    """The compiled train step of context=4 x fsdp=2: each layer's keys and values [4 local rows,
    all 32 positions, 2 kv heads, 16] are all-gathered within the 4 devices of a context group."""
    config = context_config(context=4, fsdp=2)
    trainer = mesh_trainer(config, tmp_path)
    hlo, _ = trainer.program.compile_train_step()
    gathers = [line for line in hlo.as_text().splitlines()
               if "= f32[4,32,2,16]" in line and " all-gather(" in line]
    assert len(gathers) >= 2, "no all-gather of K/V over the context axis"
    for line in gathers:  # written as explicit groups or, by newer XLAs, as mesh axes
        assert replica_groups(line) == [[0, 1, 2, 3], [4, 5, 6, 7]], line


def run_cli(workdir, steps, context):
    losses, stdout = resumable_cli_losses(workdir, steps, **{"mesh.context": context})
    assert f"'context': {context}" in stdout  # the start-up line's mesh
    return losses


@pytest.mark.slow
def test_cli_trains_tiny_with_context_and_restores_across_degrees(tmp_path):
    """configs/tiny.py (concat-packed documents, positions restarting in each) through the CLI:
    context=4 for steps 1-2, restored on context=2 for steps 3-4. Every step's loss equals the
    run without a context axis."""
    plain = run_cli(tmp_path / "plain", 4, 1)
    joined = {**run_cli(tmp_path / "a", 2, 4), **run_cli(tmp_path / "a", 4, 2)}
    assert sorted(joined) == sorted(plain) == [1, 2, 3, 4]
    np.testing.assert_allclose([joined[s] for s in range(1, 5)],
                               [plain[s] for s in range(1, 5)], rtol=1e-4)


@pytest.mark.slow
def test_a_context_axis_across_two_hosts_trains_like_one_host(tmp_path):
    """mesh.dcn.context=2: each process holds half of every row's tokens (the input pipeline
    passes whole rows and each device takes its load-balanced slice); the losses are those of one
    process without a context axis."""
    from tests.test_layouts import launch_two, losses, one_process_losses

    run = launch_two(tmp_path / "two", "--config.mesh.dcn.context=2", "--config.mesh.context=2",
                     "--config.mesh.data=2")
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    two, one = losses(tmp_path / "two"), one_process_losses(tmp_path / "one",
                                                            ["--config.mesh.data=8"])
    assert sorted(two) == sorted(one) == [3, 6]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
