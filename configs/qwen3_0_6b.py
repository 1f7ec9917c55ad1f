"""Qwen3-0.6B shapes (596M parameters, tied embeddings), for one GPU/TPU host and up.

    python -m jaxscale.train --config=configs/qwen3_0_6b.py --workdir=runs/qwen3_0_6b

The shapes are Qwen/Qwen3-0.6B's config.json: 28 layers of d_model 1024, 16 query heads and 8
key/value heads of head_dim 128 (so the heads are 2048 wide, twice d_model), a SwiGLU of 3072, a
vocabulary of 151936, RoPE theta 1e6 for 40960 positions, RMSNorm epsilon 1e-6, and per-head q/k
norms (jaxscale/models/qwen3.py). It trains on the byte-tokenized standard-library corpus by
default; to fine-tune the published weights, use configs/hf.py (docs/huggingface.md).
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.update(name="qwen3", vocab_size=151936, d_model=1024, n_layers=28, n_heads=16,
                   n_kv_heads=8, head_dim=128, mlp_dim=3072, max_seq_len=40960,
                   rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, remat="save_dots")
    c.train.update(steps=10000, batch_size=64, seq_len=2048, log_every=20, eval_every=1000)
    c.optim.update(lr=3e-4, warmup_steps=500)
    # Shard parameters and optimizer state over every device (ZeRO-3 style).
    c.mesh.update(data=1, fsdp=-1)
    return c
