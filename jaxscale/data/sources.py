"""Document sources: each returns one epoch of documents, as token-id arrays, for a split.

Sources return random-access `grain.MapDataset`s so that the pipeline can shard, shuffle and
checkpoint them by index. Documents carry no BOS/EOS; the pipeline frames them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig

import grain
import numpy as np

from jaxscale.errors import JaxscaleError

SPLITS = ("train", "eval")

# Installed third-party packages live inside the stdlib directory but differ from machine to
# machine; leaving them out keeps the corpus identical wherever this Python version runs.
_NOT_STDLIB = ("site-packages", "dist-packages", "__pycache__")

SYNTHETIC_DOCUMENTS = {"train": 100_000, "eval": 1_000}


def in_eval_split(key: str, eval_fraction: float) -> bool:
    """Whether the document named `key` is held out for eval.

    A hash of the name rather than its position in a listing, so adding or removing other files
    never moves a document between train and eval.
    """
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < eval_fraction * 2.0 ** 64


def stdlib_files() -> tuple[str, list[str]]:
    """(root, sorted relative paths) of this interpreter's standard-library `.py` files."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _NOT_STDLIB]
        paths += [os.path.relpath(os.path.join(directory, f), root)
                  for f in files if f.endswith(".py")]
    return root, sorted(paths)


def _read_and_encode(root: str, tokenizer, relative_path: str) -> np.ndarray:
    with open(os.path.join(root, relative_path), "rb") as f:
        return tokenizer.encode(f.read())


def stdlib_documents(split: str, eval_fraction: float, tokenizer) -> grain.MapDataset:
    """One document per standard-library `.py` file of `split`."""
    root, paths = stdlib_files()
    wanted = split == "eval"
    paths = [p for p in paths if in_eval_split(p, eval_fraction) == wanted]
    if not paths:
        raise JaxscaleError(f"the standard library at {root} has no .py files for the {split} "
                            "split; use data.source='synthetic'")
    return grain.MapDataset.source(paths).map(
        functools.partial(_read_and_encode, root, tokenizer))


def _random_document(seed: int, split: str, first_id: int, vocab_size: int, max_length: int,
                     index: int) -> np.ndarray:
    rng = np.random.default_rng([seed, SPLITS.index(split), index])
    length = rng.integers(1, max_length + 1)
    return rng.integers(first_id, vocab_size, size=length, dtype=np.int32)


def synthetic_documents(split: str, seed: int, tokenizer, max_length: int) -> grain.MapDataset:
    """Random documents of 1..`max_length` ordinary tokens, a function of (seed, split, index).

    For benchmarks and tests: no file is read and the content costs almost nothing to make.
    """
    first_id = max(tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) + 1
    return grain.MapDataset.range(SYNTHETIC_DOCUMENTS[split]).map(functools.partial(
        _random_document, seed, split, first_id, tokenizer.vocab_size, max_length))
