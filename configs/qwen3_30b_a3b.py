"""Qwen3-30B-A3B shapes (30.5B parameters, 3.3B active per token), for a TPU slice or several
GPU nodes.

The shapes are Qwen/Qwen3-30B-A3B's config.json: 48 layers of d_model 2048, 32 query heads and 4
key/value heads of head_dim 128, per-head q/k norms (jaxscale/models/qwen3_moe.py), and in every
layer 128 SwiGLU experts of width 768 behind a top-8 router whose weights are renormalised; a
vocabulary of 151936, RoPE theta 1e6 for 40960 positions, RMSNorm epsilon 1e-6, an untied head.

    python -m jaxscale.train --config=configs/qwen3_30b_a3b.py --workdir=runs/qwen3_30b_a3b

Defaults to FSDP over all devices with full rematerialisation; `--config.mesh.expert=N` splits
the experts over N devices (docs/parallelism.md). To fine-tune the published weights, use
configs/hf.py (docs/huggingface.md), which routes dropless as transformers does.

Qwen3-MoE's router_aux_loss_coef (0.001) weighs a load-balancing loss top_k times this one's
(its expert loads sum to top_k, here to 1), hence aux_loss_weight 0.008.
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.update(name="qwen3_moe", vocab_size=151936, d_model=2048, n_layers=48, n_heads=32,
                   n_kv_heads=4, head_dim=128, mlp_dim=768, max_seq_len=40960,
                   rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=False, remat="full")
    c.model.moe.update(experts=128, top_k=8, every=1, capacity_factor=1.25,
                       aux_loss_weight=0.008)
    c.train.update(steps=10000, batch_size=256, seq_len=4096, log_every=10, eval_every=1000)
    c.optim.update(lr=3e-4, warmup_steps=2000)
    c.mesh.update(data=1, fsdp=-1)
    return c
