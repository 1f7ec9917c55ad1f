"""The tiny model fine-tuned to answer questions about the Python standard library: a chat
fine-tune that runs anywhere in a few minutes, nothing downloaded (docs/finetuning.md).

    python -m jaxscale.train                                        # the base: runs/default
    python -m jaxscale.data.stdlib_chat --out=runs/stdlib_chat.jsonl
    python -m jaxscale.train --config=configs/tiny_chat.py --workdir=runs/tiny_chat

`configs/tiny_chat.py:FILE` trains on another chat JSONL. The run starts from the parameters of
runs/default (the README's first command: the tiny model after 200 steps on the standard
library's source; checkpoint.restore_from), with a fresh optimizer, and learns only the replies
(data.packing='first_fit' keeps each conversation whole in one row). Every 50 steps it logs the
greedy answers to two questions, asked in the built-in chat template as the data is rendered:
one the data answers (shutil.copyfile's docstring), one it does not (json.dumps's signature is
too long for stdlib_chat to keep). LoRA, and the run tracked in MLflow: docs/finetuning.md.
"""

from jaxscale.config import default_config

DATA = "runs/stdlib_chat.jsonl"
# A question as the built-in template renders a user turn and the assistant's header
# (jaxscale/data/chat.py, BUILTIN_TEMPLATE with add_generation_prompt=True).
PROMPT = "<|user|>\n{}<|end|>\n<|assistant|>\n"
QUESTIONS = ("How do I call json.dumps?", "What does shutil.copyfile do?")


def get_config(path: str = DATA):
    c = default_config()
    c.data.sources = (dict(format="chat", path=path, eval_fraction=0.05),)
    c.data.packing = "first_fit"
    # 256 byte tokens hold every conversation stdlib_chat writes (MAX_ANSWER_CHARS), about two
    # to a row.
    c.train.update(steps=200, seq_len=256, log_every=10, eval_every=100, eval_batches=4,
                   sample_every=50, sample_tokens=64,
                   sample_prompts=tuple(PROMPT.format(q) for q in QUESTIONS))
    c.checkpoint.update(restore_from="runs/default", restore_params_only=True, every_steps=100)
    # Two thirds of pretraining's peak rate and a short warm-up: at a tenth of it (3e-4) the
    # tiny model still repeated "a the a" after 300 steps.
    c.optim.update(lr=2e-3, warmup_steps=10)
    return c
