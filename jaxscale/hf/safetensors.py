"""The safetensors format, read through numpy.memmap and written tensor by tensor.

A file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}, plus optional "__metadata__") and the raw little-endian bytes of every tensor.
Our own ~100 lines rather than the `safetensors` package: its numpy API has no bfloat16 (numpy has
none; ml_dtypes, which JAX already needs, does), and a memmap slice reads only the bytes a
device's shard needs.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Callable, Iterable, NamedTuple

import ml_dtypes
import numpy as np

from jaxscale.errors import JaxscaleError

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class TensorInfo(NamedTuple):
    path: str  # the file that holds it
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file


def read_header(path: str) -> dict[str, TensorInfo]:
    """{tensor name: where and what it is}; JaxscaleError naming the file when it is not a
    safetensors file (or holds a dtype jaxscale does not load)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} does not fit the file's {size} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise JaxscaleError(f"{path} is not a readable safetensors file ({e}); re-download it "
                            "or save it again with save_pretrained(safe_serialization=True)"
                            ) from None
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise JaxscaleError(f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}; "
                                f"jaxscale loads {sorted(DTYPES)}")
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize or start + end > size:
            raise JaxscaleError(f"{path}: tensor {name!r} {list(shape)} does not fit its byte "
                                f"range {begin}..{end} (file of {size} bytes); the file is "
                                "truncated or damaged: re-download it")
        tensors[name] = TensorInfo(path, dtype, shape, start + begin)
    return tensors


def read_slice(info: TensorInfo, view: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """A copy of `index` of the tensor reshaped to `view`, reading only the pages it touches.

    The map is unmapped when this returns (nothing else refers to it), so the pages read for
    one shard do not stay in this process's memory while the next is read.
    """
    mapped = np.memmap(info.path, dtype=info.dtype, mode="r", offset=info.offset,
                       shape=info.shape)
    return np.array(mapped.reshape(view)[index])


def write(path: str, names: list[str], shapes: list[tuple[int, ...]], dtype: np.dtype,
          produce: Callable[[str], np.ndarray]) -> None:
    """Writes tensors `names` (all of `dtype`) to `path`, asking `produce(name)` for each in turn,
    so only one tensor is in host memory at a time."""
    dtype = np.dtype(dtype)
    header, offset = {"__metadata__": {"format": "pt"}}, 0  # "pt": what transformers checks
    for name, shape in zip(names, shapes):
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape in zip(names, shapes):
            array = np.ascontiguousarray(produce(name), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"{name}: produced {array.shape}, announced {shape}")
            f.write(array.reshape(-1).view(np.uint8).data)


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped, in order, into files of at most `max_bytes` (a larger tensor gets a
    file of its own), as transformers' save_pretrained shards."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards
