"""Fine-tune a local Hugging Face Llama folder (config.json, safetensors, tokenizer.json):

    python -m jaxscale.train --config=configs/hf.py:/path/to/Llama-3.2-1B --workdir=runs/ft \
        --config.data.sources="(dict(format='jsonl', path='my_data.jsonl'),)"

The model section comes from the folder's config.json, the tokenizer from its tokenizer.json
(BOS/EOS from config.json's ids), and the weights from the folder itself
(checkpoint.restore_from: parameters only, a fresh optimizer from step 0). A folder without a
tokenizer.json keeps data.tokenizer='byte'; set --config.data.tokenizer. See docs/huggingface.md.
"""

from jaxscale.config import default_config
from jaxscale.errors import ConfigError
from jaxscale.hf.config import update_config


def get_config(path: str = ""):
    if not path:
        raise ConfigError("configs/hf.py needs the model folder: "
                          "--config=configs/hf.py:/path/to/model")
    c = default_config()
    update_config(c, path, "configs/hf.py's folder")
    c.train.update(steps=1000, batch_size=16, seq_len=1024, log_every=10, eval_every=200)
    # Fine-tuning: a small learning rate, short warm-up, no weight decay pulling the pre-trained
    # weights towards zero.
    c.optim.update(lr=2e-5, warmup_steps=50, min_lr_ratio=0.1, weight_decay=0.0)
    c.model.remat = "full"
    c.mesh.update(data=1, fsdp=-1)  # parameters and optimizer state sharded over every device
    c.checkpoint.every_steps = 200
    return c
