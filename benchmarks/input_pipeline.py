"""How much faster the input pipeline delivers tokens than the train step consumes them.

    python benchmarks/input_pipeline.py [--config=configs/tiny.py] [--batches=200] [--batch_size=N]

Measures, in one run on this machine: tokens/s the pipeline delivers (as global arrays, the way
the trainer takes them) from the byte-tokenized stdlib corpus and from the same corpus
pre-tokenized by `jaxscale.data.prepare`; and tokens/s the config's train step consumes. The last
line is `ratio: X`, the slower pipeline's rate over the step's; below 1 the step waits for data.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax

from jaxscale.cli import load_config_file
from jaxscale.data import make_input, prepare
from jaxscale.trainer import Trainer

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def delivered_tokens_per_second(config, batch_sharding, batches: int) -> float:
    it = make_input(config, "train", batch_sharding)
    jax.block_until_ready(next(it))  # start-up (listing, first reads) is not throughput
    begin = time.perf_counter()
    for _ in range(batches):
        batch = next(it)
    jax.block_until_ready(batch)
    seconds = time.perf_counter() - begin
    it.close()
    return batches * config.train.batch_size * config.train.seq_len / seconds


def consumed_tokens_per_second(trainer: Trainer, steps: int) -> float:
    config = trainer.config
    it = make_input(config, "train", trainer.batch_sharding)
    batch = next(it)
    it.close()
    state = trainer.init_state(0)
    state, _ = trainer.train_step(state, batch)  # compile
    jax.block_until_ready(state)
    begin = time.perf_counter()
    for _ in range(steps):
        state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - begin
    return steps * config.train.batch_size * config.train.seq_len / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(_REPO, "configs", "tiny.py"))
    parser.add_argument("--batches", type=int, default=200, help="batches timed per pipeline")
    parser.add_argument("--steps", type=int, default=20, help="train steps timed")
    parser.add_argument("--batch_size", type=int, default=0,
                        help="train.batch_size, i.e. row streams (0: the config's)")
    args = parser.parse_args()

    config = load_config_file(args.config)
    config.train.batch_size = args.batch_size or config.train.batch_size
    config.data.sources = (dict(format="stdlib"),)
    config.data.tokenizer = "byte"
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        sharding = trainer.batch_sharding
        print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, batch "
              f"{config.train.batch_size} x {config.train.seq_len} tokens", flush=True)

        text = delivered_tokens_per_second(config, sharding, args.batches)
        print(f"delivered, stdlib text, byte tokenizer: {text:,.0f} tokens/s", flush=True)

        tokens_config = config.copy_and_resolve_references()
        tokens_config.data.sources = tuple(prepare.prepare(
            config, os.path.join(workdir, "tokens"), workers=os.cpu_count()))
        pretokenized = delivered_tokens_per_second(tokens_config, sharding, args.batches)
        print(f"delivered, pre-tokenized files:         {pretokenized:,.0f} tokens/s",
              flush=True)

        consumed = consumed_tokens_per_second(trainer, args.steps)
        print(f"consumed by the train step:             {consumed:,.0f} tokens/s", flush=True)
    print(f"ratio: {min(text, pretokenized) / consumed:.1f}")


if __name__ == "__main__":
    main()
