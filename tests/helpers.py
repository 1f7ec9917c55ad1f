"""Small configs and batches shared by the tests."""

import numpy as np

from jaxscale.config import default_config


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
