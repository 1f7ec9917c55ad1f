"""Llama 3 8B shapes (8.03B parameters), for a GPU node (8x H100) or a TPU slice and up.

Llama 3 (not 3.1): 8192 positions, plain RoPE (model.rope_scaling.type stays "none").

    python -m jaxscale.train --config=configs/llama3_8b.py --workdir=runs/llama3_8b

Defaults to FSDP over all devices with full rematerialisation; add tensor parallelism with
--config.mesh.tensor=N (N dividing 8, the KV head count) on larger pods.
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.update(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   head_dim=128, mlp_dim=14336, max_seq_len=8192, rope_theta=500000.0,
                   tie_embeddings=False, remat="full")
    c.train.update(steps=10000, batch_size=256, seq_len=8192, log_every=10, eval_every=1000)
    c.optim.update(lr=3e-4, warmup_steps=2000)
    c.mesh.update(data=1, fsdp=-1)
    return c
