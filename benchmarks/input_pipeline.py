"""Whether one host's input pipeline keeps an 8-GPU node fed.

    python benchmarks/input_pipeline.py [--config=configs/tiny.py] [--batches=20]
        [--batch_size=64] [--seq_len=2048] [--path=gs://BUCKET/DIR | s3://BUCKET/DIR [--emulator]]

Measures, in one run on this machine: tokens/s the pipeline delivers to one host (as global
arrays, the way the trainer takes them, with `data.workers` reader threads, -1: the pipeline's
choice), from the byte-tokenized stdlib corpus and from the same corpus pre-tokenized by
`jaxscale.data.prepare`, at llama_1b's row length and a batch of 8 GPUs x 8 rows. It sets these
against what one node of 8 H100s consumes training llama_1b at the rate `benchmarks/RESULTS.md`
records (44,039 tokens/s per GPU with `mesh.auto`, recorded at 57a4e9d): 352,312 tokens/s.
The last line is `ratio: X`, the slower pipeline's rate over the node's; below 1 the GPUs would
wait for data. This machine has 2 cores; an accelerator host has tens, so the figure is a floor.

With `--path=gs://...` or `s3://...` it measures instead what reading from a bucket keeps of local
disk's rate: the pre-tokenized files, written locally and copied to `--path`, are read from each,
and the last line is `ratio: X`, the bucket's tokens/s over local disk's (target: 0.8). The
bucket is whatever the standard variables point at (STORAGE_EMULATOR_HOST, AWS_ENDPOINT_URL,
or none: the cloud); `--emulator` starts a local server on a free loopback port first
(fake-gcs-server for gs://, which answers requests concurrently as GCS does; moto's server for
s3://; as tests/storage_servers.py does) and makes the bucket, so no cloud account is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import jax

from jaxscale.cli import load_config_file
from jaxscale.data import make_input, prepare
from jaxscale.runtime.storage import filesystem
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


# llama_1b on one H100 (benchmarks/RESULTS.md, "One NVIDIA H100 80GB HBM3", mesh.auto row), and
# the GPUs one host drives.
H100_LLAMA_1B_TOKENS_PER_GPU = 44_039
GPUS_PER_NODE = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(_REPO, "configs", "tiny.py"))
    parser.add_argument("--batches", type=int, default=20, help="batches timed per pipeline")
    parser.add_argument("--batch_size", type=int, default=GPUS_PER_NODE * 8,
                        help="train.batch_size, i.e. row streams")
    parser.add_argument("--seq_len", type=int, default=2048, help="train.seq_len")
    parser.add_argument("--workers", type=int, default=-1, help="data.workers")
    parser.add_argument("--path", default="", help="a bucket folder (gs://, s3://): measure "
                        "reading the token files from it against local disk")
    parser.add_argument("--emulator", action="store_true",
                        help="with --path: serve the bucket from a local server")
    args = parser.parse_args()

    config = load_config_file(args.config)
    config.train.update(batch_size=args.batch_size, seq_len=args.seq_len)
    config.model.max_seq_len = max(config.model.max_seq_len, args.seq_len)
    config.data.workers = args.workers
    config.data.sources = (dict(format="stdlib"),)
    config.data.tokenizer = "byte"
    if args.path:
        with (local_server(args.path) if args.emulator
              else contextlib.nullcontext()):
            bucket_against_disk(config, args.path, args.batches)
        return
    with tempfile.TemporaryDirectory() as workdir:
        trainer = Trainer(config, workdir)
        sharding = trainer.program.batch_sharding
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

    node = GPUS_PER_NODE * H100_LLAMA_1B_TOKENS_PER_GPU
    print(f"consumed by 8 H100s training llama_1b:   {node:,.0f} tokens/s (RESULTS.md)")
    print(f"ratio: {min(text, pretokenized) / node:.2f}")


@contextlib.contextmanager
def local_server(path: str):
    """A GCS- or S3-API server for `path`'s scheme on a free loopback port, the standard
    variables pointing at it and `path`'s bucket made, for the duration."""
    sys.path.insert(0, _REPO)
    from tests import storage_servers  # the tests' servers, started the same way

    scheme, bucket = path.split("://")[0], path.split("://")[1].split("/")[0]
    start = {"gs": storage_servers.gcs_server, "s3": storage_servers.s3_server}[scheme]
    with start(bucket) as server:
        print(f"server: {server.url} ({scheme}://{bucket})", flush=True)
        yield


ROUNDS = 2


def bucket_against_disk(config, path: str, batches: int) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        sharding = Trainer(config, workdir).program.batch_sharding
        print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}, batch "
              f"{config.train.batch_size} x {config.train.seq_len} tokens", flush=True)
        local_dir = os.path.join(workdir, "tokens")
        local_sources = tuple(prepare.prepare(config, local_dir, workers=os.cpu_count()))
        fs, root = filesystem(path, "--path")
        fs.put(local_dir + "/", root.rstrip("/") + "/", recursive=True)
        bucket_sources = tuple(dict(s, path=s["path"].replace(local_dir, path.rstrip("/")))
                               for s in local_sources)
        rates = {"local disk": 0.0, "bucket": 0.0}
        # Alternated, the best of each kept: this VM's load moves a single run by tens of %.
        for _ in range(ROUNDS):
            for where, chosen in (("local disk", local_sources), ("bucket", bucket_sources)):
                source_config = config.copy_and_resolve_references()
                source_config.data.sources = chosen
                rate = delivered_tokens_per_second(source_config, sharding, batches)
                rates[where] = max(rates[where], rate)
                print(f"delivered, pre-tokenized files, {where}: {rate:,.0f} tokens/s",
                      flush=True)
    print(f"ratio: {rates['bucket'] / rates['local disk']:.2f}")


if __name__ == "__main__":
    main()
