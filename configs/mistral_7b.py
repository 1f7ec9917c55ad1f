"""Mistral 7B v0.1 shapes (7.24B parameters), for a GPU node (8x H100) or a TPU slice and up.

    python -m jaxscale.train --config=configs/mistral_7b.py --workdir=runs/mistral_7b

The shapes are mistralai/Mistral-7B-v0.1's config.json: 32 layers of d_model 4096, 32 query and
8 key/value heads of head_dim 128, a SwiGLU of 14336, a vocabulary of 32000, RoPE theta 1e4 for
32768 positions, and a sliding window of 4096 tokens in every layer (jaxscale/models/mistral.py),
which the 8192-token rows here go past. To fine-tune the published weights, use configs/hf.py
(docs/huggingface.md). Defaults to FSDP over all devices with full rematerialisation.
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.update(name="mistral", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                   n_kv_heads=8, head_dim=128, mlp_dim=14336, max_seq_len=32768,
                   sliding_window=4096, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
                   remat="full")
    c.train.update(steps=10000, batch_size=256, seq_len=8192, log_every=10, eval_every=1000)
    c.optim.update(lr=3e-4, warmup_steps=2000)
    c.mesh.update(data=1, fsdp=-1)
    return c
