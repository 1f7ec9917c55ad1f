"""`python -m jaxscale.data.prepare --config=configs/NAME.py --out=DIR [--workers=N]`

Tokenizes every text source of the config once, in parallel, into pre-tokenized files
(`DIR/source<i>.<split>.bin`, see token_files.py), and prints the `data.sources` that train on
them. Training then reads token ids instead of parsing and tokenizing text. DIR may be in a
bucket (gs://, s3://; `pip install 'jaxscale[cloud]'`), and the printed sources then read from it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

from jaxscale.cli import Option, fail, fail_with, parse_config_flags
from jaxscale.data.specs import source_specs
from jaxscale.errors import JaxscaleError, TransientError, json_object
from jaxscale.kinds import whole
from jaxscale.observe.progress import StatusLine
from jaxscale.runtime.storage import check_bucket, classified, filesystem, in_bucket

MANIFEST = "prepare.json"  # in the --out folder: which sources and tokenizer its files are from
_MANIFEST_FORMAT = "jaxscale-prepare-v1"
_WRITE_FIX = "give a folder you can write to"
_CHUNK = 256  # documents per task: large enough to amortize the hand-off, small for an even load
_REDRAW_SECONDS = 0.5


class _Progress:
    """The count of one source's split, redrawn on a terminal; elsewhere only the final count."""

    def __init__(self, label: str, total: int):
        self.label, self.total = label, total
        self.start = time.perf_counter()
        self.line = StatusLine(sys.stderr, _REDRAW_SECONDS)

    def update(self, done: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not (final or (self.line.interactive and self.line.due(now))):
            return
        rate = tokens / max(now - self.start, 1e-9)
        text = (f"{self.label}: {done}/{self.total} documents, {tokens:,} tokens "
                f"({rate:,.0f} tokens/s)")
        if self.line.interactive:
            self.line.draw(text, now)
            if final:
                self.line.finish()
        else:
            print(text, file=sys.stderr, flush=True)


_worker_documents = None


def _init_worker(documents) -> None:
    global _worker_documents
    _worker_documents = documents


def _tokenize(indices: range) -> list:
    return [_worker_documents[i] for i in indices]


def prepare_source(documents, stem: str, label: str, workers: int, vocab_size: int,
                   tokenizer_name: str) -> dict:
    """Tokenizes the `documents` MapDataset into `stem` token files, keeping their order."""
    from jaxscale.data.token_files import write_token_file

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
    """Writes token files for each text source and returns the `data.sources` reading them.

    JaxscaleError, before anything is written, when a source or split holds no documents, or
    `out` is a file, or a folder holding token files of other sources or another tokenizer.
    Running it again with the same sources and tokenizer overwrites the files it wrote (e.g.
    after an interrupted run, or when the data changed).
    """
    from jaxscale.data import sources  # imports JAX; after the flags
    from jaxscale.data.tokenizers import tokenizer_from_config

    tokenizer = tokenizer_from_config(config)
    specs = source_specs(config)
    if in_bucket(out):
        check_bucket(out, "--out")
    fs, root = filesystem(out, "--out")
    if fs.isfile(root):
        raise JaxscaleError(f"--out={out!r} is a file, not a folder; give a folder for the "
                            "token files (it is created if missing)")
    sources.check_splits(config, sources.SPLITS, eval_optional=False)
    manifest = _manifest(specs, tokenizer.name)
    _check_out(fs, root, out, manifest)
    # Refused, a file in the way: exit 2; EIO, a 5xx: 75.
    with classified(f"--out={out!r} cannot be written", _WRITE_FIX):
        fs.makedirs(root, exist_ok=True)
        # First: a rerun of an interrupted prepare finds the files described.
        fs.pipe_file(f"{root}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
    prepared = []
    for i, spec in enumerate(specs):
        if spec["format"] in ("synthetic", "tokens", "chat"):
            # Token files hold no loss mask: chat sources are read as they are.
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


def _manifest(specs: list[dict], tokenizer_name: str) -> dict:
    """What the token files of a folder are made from: the sources (less their weights, which
    only mix them) and the tokenizer."""
    described = [{k: v for k, v in spec.items() if k not in ("name", "weight")}
                 for spec in specs]
    return json.loads(json.dumps({"format": _MANIFEST_FORMAT, "tokenizer": tokenizer_name,
                                  "sources": described}, default=str))


def _check_out(fs, root: str, out: str, manifest: dict) -> None:
    """Refuses a folder (`root` in `fs`, given as `out`) holding token files made from other
    sources or by another tokenizer: overwriting them could break the runs that train on them."""
    if not fs.isdir(root):
        return
    token_files = sorted(p for p in fs.ls(root, detail=False)
                         if os.path.basename(p).startswith("source"))
    manifest_path = f"{root}/{MANIFEST}"
    if not fs.exists(manifest_path):
        if token_files:
            raise JaxscaleError(
                f"--out={out!r} already holds token files ({os.path.basename(token_files[0])}, "
                f"...) but no {MANIFEST} saying what they were made from; give a new folder, or "
                "delete those files to write new ones there")
        return
    fix = f"give a new folder, or delete its {MANIFEST} and source* files"
    with classified(f"cannot read {manifest_path!r}", fix):  # refused: 2; EIO, a 5xx: 75
        read = fs.cat_file(manifest_path)
    try:
        before = json.loads(read)
    except ValueError as e:  # not JSON: bytes that were read
        raise JaxscaleError(f"--out={out!r} has an unreadable {MANIFEST} ({e}); {fix}") from None
    json_object(before, manifest_path, fix)
    if before == manifest:
        print(f"{out}: overwriting the token files prepared before from the same sources and "
              "tokenizer", file=sys.stderr)
        return
    if before.get("tokenizer") != manifest["tokenizer"]:
        differs = (f"tokenizer {before.get('tokenizer')!r} then, {manifest['tokenizer']!r} "
                   "now")
    else:
        then, now = before.get("sources") or [], manifest["sources"]
        i = next((i for i, (a, b) in enumerate(zip(then, now)) if a != b), min(len(then), len(now)))
        if i < min(len(then), len(now)):
            differs = f"data.sources[{i}] was {then[i]!r}, is now {now[i]!r}"
        else:
            differs = f"{len(then)} sources then, {len(now)} now"
    raise JaxscaleError(f"--out={out!r} already holds token files of another config ({differs}); "
                        f"give a new folder, or delete its {MANIFEST} and source* files to "
                        "replace them")


def main(argv: list[str]) -> None:
    config, values = parse_config_flags(
        argv, prog="python -m jaxscale.data.prepare", about=__doc__,
        config_help="the config whose data.sources and data.tokenizer to prepare",
        options=[Option("out", "", "folder for the token files (required)", "DIR"),
                 Option("workers", os.cpu_count() or 1, "processes tokenizing in parallel", "N",
                        kind=whole("[1, inf)"))])
    if not values["out"]:
        fail("--out=DIR is required: the folder to write the token files to")
    try:
        prepared = prepare(config, values["out"], values["workers"])
    except (JaxscaleError, TransientError) as e:
        fail_with(e)
    print("Train on the token files with:\n"
          f"    config.data.sources = {tuple(prepared)!r}")


if __name__ == "__main__":
    main(sys.argv)
