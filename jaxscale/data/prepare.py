"""`python -m jaxscale.data.prepare --config=configs/NAME.py --out=DIR [--workers=N]`

Tokenizes every text source of the config once, in parallel, into pre-tokenized files
(`DIR/source<i>.<split>.bin`, see token_files.py), and prints the `data.sources` that train on
them. Training then reads token ids memory-mapped instead of parsing and tokenizing text.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

from absl import flags
from ml_collections import config_flags

from jaxscale.errors import JaxscaleError
from jaxscale.train import DEFAULT_CONFIG, fail

_CHUNK = 256  # documents per task: large enough to amortize the hand-off, small for an even load
_REDRAW_SECONDS = 0.5


class _Progress:
    """One line redrawn in place on a terminal; elsewhere only the final count, so logs stay
    clean."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.start = self.drawn = time.perf_counter()
        self.interactive = sys.stderr.isatty()

    def update(self, done: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and (not self.interactive or now - self.drawn < _REDRAW_SECONDS):
            return
        self.drawn = now
        rate = tokens / max(now - self.start, 1e-9)
        line = (f"{self.label}: {done}/{self.total} documents, {tokens:,} tokens "
                f"({rate:,.0f} tokens/s)")
        end = "\n" if final else ""
        print(("\r" if self.interactive else "") + line, end=end, file=sys.stderr, flush=True)


_worker_documents = None


def _init_worker(documents) -> None:
    global _worker_documents
    _worker_documents = documents


def _tokenize(indices: range) -> list:
    return [_worker_documents[i] for i in indices]


def prepare_source(documents, stem: str, label: str, workers: int, vocab_size: int,
                   tokenizer_name: str) -> dict:
    """Tokenizes the `documents` MapDataset into `stem` token files, keeping their order."""
    from jaxscale.data.token_files import write_token_file  # noqa: PLC0415

    progress = _Progress(label, len(documents))
    counts = {"done": 0, "tokens": 0}

    def tokenized(chunks):
        for chunk in chunks:
            for tokens in chunk:
                counts["done"] += 1
                if tokens is not None:  # a malformed record, already counted and logged
                    counts["tokens"] += len(tokens)
                    yield tokens
            progress.update(counts["done"], counts["tokens"])

    tasks = [range(start, min(start + _CHUNK, len(documents)))
             for start in range(0, len(documents), _CHUNK)]
    # spawn, not fork: the parent has imported JAX, whose threads do not survive a fork.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(documents,)) as pool:
        meta = write_token_file(stem, tokenized(pool.imap(_tokenize, tasks)), vocab_size,
                                tokenizer_name)
    progress.update(counts["done"], counts["tokens"], final=True)
    return meta


def prepare(config, out: str, workers: int) -> list[dict]:
    """Writes token files for each text source and returns the `data.sources` reading them."""
    from jaxscale.data import sources  # noqa: PLC0415 — imports JAX; after the flags
    from jaxscale.data.tokenizers import tokenizer_from_config  # noqa: PLC0415

    tokenizer = tokenizer_from_config(config)
    os.makedirs(out, exist_ok=True)
    prepared = []
    for i, spec in enumerate(sources.source_specs(config)):
        if spec["format"] in ("synthetic", "tokens"):
            print(f"{spec['name']}: {spec['format']} source, nothing to tokenize",
                  file=sys.stderr)
            prepared.append({k: v for k, v in spec.items() if k != "name"})
            continue
        paths = {}
        for split in sources.SPLITS:
            stem = os.path.join(out, f"source{i}.{split}")
            documents = sources.source_documents(spec, split, tokenizer, config)
            prepare_source(documents, stem, f"{spec['name']} {split}", workers,
                           tokenizer.vocab_size, tokenizer.name)
            paths[split] = stem + ".bin"
        prepared.append(dict(format="tokens", path=paths["train"], eval_path=paths["eval"],
                             weight=spec["weight"]))
    return prepared


def main(argv: list[str]) -> None:
    try:
        config_flag = config_flags.DEFINE_config_file(
            "config", DEFAULT_CONFIG, "Config file whose data.sources and data.tokenizer to use.")
        out_flag = flags.DEFINE_string("out", None, "Folder for the token files.")
        workers_flag = flags.DEFINE_integer("workers", os.cpu_count(),
                                            "Processes tokenizing in parallel.")
        flags.FLAGS(argv)
        config = config_flag.value
    except (flags.Error, OSError, KeyError, AttributeError, ValueError, TypeError) as e:
        fail(" ".join(str(e).split()))
    if not out_flag.value:
        fail("--out=DIR is required: the folder to write the token files to")
    if workers_flag.value < 1:
        fail(f"--workers={workers_flag.value} must be >= 1")
    try:
        prepared = prepare(config, out_flag.value, workers_flag.value)
    except JaxscaleError as e:
        fail(str(e))
    print("Train on the token files with:\n"
          f"    config.data.sources = {tuple(prepared)!r}")


if __name__ == "__main__":
    main(sys.argv)
