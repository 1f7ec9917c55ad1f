"""Llama 3.2 1B shapes (1.24B parameters, tied embeddings), for one GPU/TPU host and up.

    python -m jaxscale.train --config=configs/llama_1b.py --workdir=runs/llama_1b

It trains on the byte-tokenized standard-library corpus by default; the vocabulary keeps Llama 3's
128256 rows and the RoPE settings are Llama 3.2's, so the shapes (and FLOPs) match the published
model. To fine-tune the published weights, use configs/hf.py (docs/huggingface.md).
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.update(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                   head_dim=64, mlp_dim=8192, max_seq_len=131072, rope_theta=500000.0,
                   tie_embeddings=True, remat="save_dots")
    # Llama 3.2's RoPE: pre-trained at 8192 positions, frequencies stretched 32x for 128K.
    c.model.rope_scaling.update(type="llama3", factor=32.0, low_freq_factor=1.0,
                                high_freq_factor=4.0, original_max_seq_len=8192)
    c.train.update(steps=10000, batch_size=64, seq_len=2048, log_every=20, eval_every=1000)
    c.optim.update(lr=3e-4, warmup_steps=500)
    # Shard parameters and optimizer state over every device (ZeRO-3 style).
    c.mesh.update(data=1, fsdp=-1)
    return c
