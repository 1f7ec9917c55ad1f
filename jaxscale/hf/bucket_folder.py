"""A Hugging Face model folder in a bucket (gs://, s3://), copied once per process into a local
temporary folder, which every reader of a folder then reads as it reads a local one.

A copy rather than ranged reads from the bucket: the safetensors reader maps a file and reads the
pages each device's shard needs, and the config and tokenizer readers open files; a copy keeps
them one code path, and each object is read once, by the library's parallel downloads. Its price
is local disk for the folder's size (docs/huggingface.md), freed when the process exits.
"""

from __future__ import annotations

import os
import posixpath
import tempfile

from jaxscale.runtime.storage import check_bucket, classified, filesystem, in_bucket

# The copies made by this process, by URL; each folder removed when the process exits.
_COPIES: dict[str, tempfile.TemporaryDirectory] = {}


def local_folder(path: str, key: str) -> str:
    """`path` itself when it is local; for a bucket's folder (the flag or config key `key` gave
    it) a local copy of the files in it, made at the first call. ConfigError naming the bucket
    when it does not exist or refuses this account, TransientError when the storage fails."""
    if not in_bucket(path):
        return path
    if path not in _COPIES:
        check_bucket(path, key)
        fs, root = filesystem(path, key)
        copy = tempfile.TemporaryDirectory(prefix="jaxscale-hf-")
        fix = "point it at a Hugging Face model folder this account can read"
        try:
            with classified(f"cannot copy {key}={path!r}", fix):
                files = [entry["name"] for entry in fs.ls(root, detail=True)
                         if entry["type"] == "file"]
                fs.get(files, [os.path.join(copy.name, posixpath.basename(f)) for f in files])
        except BaseException:
            copy.cleanup()
            raise
        _COPIES[path] = copy
    return _COPIES[path].name
