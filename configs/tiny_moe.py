"""The tiny model with mixture-of-experts feed-forwards: 4 layers, each with 8 SwiGLU experts of
width 384 behind a top-2 router, so a token's active feed-forward width (2 x 384) is the dense
tiny model's 768. Trains on one CPU.

    python -m jaxscale.train --config=configs/tiny_moe.py --workdir=runs/tiny_moe

`--config.model.moe.every=2` makes every second layer MoE (the others dense, width 384).
`--config.mesh.expert=8` puts one expert on each of 8 devices (the batch split over them too);
tokens reach their experts by all-to-all.
"""

from jaxscale.config import default_config


def get_config():
    c = default_config()
    c.model.mlp_dim = 384
    c.model.moe.update(experts=8, top_k=2, every=1)
    return c
