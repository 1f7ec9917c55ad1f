"""Mixtral 8x7B shapes (46.7B parameters, 12.9B active per token), for a TPU slice or several
GPU nodes.

Every layer's feed-forward is 8 SwiGLU experts of width 14336 behind a top-2 router; attention is
Mistral 7B's (32 heads, 8 KV heads), RoPE base 1e6, 32000-token vocabulary.

    python -m jaxscale.train --config=configs/mixtral_8x7b.py --workdir=runs/mixtral_8x7b

Defaults to FSDP over all devices with full rematerialisation. With `--config.mesh.expert=8`
each device holds one expert of each MoE layer (FSDP-split over the fsdp axis, which takes the
other devices) and tokens reach their experts by all-to-all (docs/parallelism.md).

The model is a `mixtral` (jaxscale/models/mixtral.py), so an export is a MixtralForCausalLM;
to fine-tune the published weights, use configs/hf.py (docs/huggingface.md).

Mixtral's own router_aux_loss_coef (0.02) weighs a load-balancing loss top_k times this one's
(its expert loads sum to top_k, here to 1), hence aux_loss_weight 0.04.
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.update(name="mixtral", vocab_size=32000, d_model=4096, n_layers=32, n_heads=32,
                   n_kv_heads=8, head_dim=128, mlp_dim=14336, max_seq_len=32768, rope_theta=1e6,
                   tie_embeddings=False, remat="full")
    c.model.moe.update(experts=8, top_k=2, every=1, capacity_factor=1.25, aux_loss_weight=0.04)
    c.train.update(steps=10000, batch_size=256, seq_len=4096, log_every=10, eval_every=1000)
    c.optim.update(lr=3e-4, warmup_steps=2000)
    c.mesh.update(data=1, fsdp=-1)
    return c
