"""A 3.3M-parameter Llama on the byte-tokenized Python standard library; trains on one CPU.

    python -m jaxscale.train --config=configs/tiny.py --workdir=runs/tiny
"""

from jaxscale.config import default_config


def get_config():
    # The defaults *are* the tiny model: d_model 256, 4 layers, 8 heads (4 KV), vocab 259 -> 384.
    return default_config()
