"""Gemma 3 1B shapes (1.0B parameters), for one GPU or a small TPU slice.

    python -m jaxscale.train --config=configs/gemma3_1b.py --workdir=runs/gemma3_1b

The shapes are google/gemma-3-1b-pt's config.json (transformers' Gemma3TextConfig docs): 26
layers of d_model 1152, 4 query heads and 1 key/value head of head_dim 256, a GeGLU of 6912, a
vocabulary of 262144 tied to the head, 32768 positions. Every 6th layer is global (RoPE base
1e6); the others see a window of 512 tokens with RoPE base 1e4 (jaxscale/models/gemma3.py). To
fine-tune the published weights, use configs/hf.py (docs/huggingface.md). Defaults to FSDP over
all devices with full rematerialisation.
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.update(name="gemma3", vocab_size=262144, d_model=1152, n_layers=26, n_heads=4,
                   n_kv_heads=1, head_dim=256, mlp_dim=6912, max_seq_len=32768,
                   sliding_window=512, global_every=6, rope_theta=1000000.0,
                   rope_local_theta=10000.0, query_pre_attn_scalar=256, norm_eps=1e-6,
                   tie_embeddings=True, remat="full")
    c.train.update(steps=10000, batch_size=64, seq_len=4096, log_every=10, eval_every=1000)
    c.optim.update(lr=3e-4, warmup_steps=2000)
    c.mesh.update(data=1, fsdp=-1)
    return c
