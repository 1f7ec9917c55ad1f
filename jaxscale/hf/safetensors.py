"""The safetensors format, read through numpy.memmap and written tensor by tensor.

A file is an 8-byte little-endian header length N, N bytes of JSON header ({name: {dtype, shape,
data_offsets}}, plus optional "__metadata__": {str: str}) and the data section: the raw
little-endian bytes of every tensor, `data_offsets` [begin, end) counted from its start. As the
format's specification requires, the tensors' ranges cover the data section exactly, without
overlaps or holes, so no byte is read as two tensors (nor the header as weights).

Our own reader rather than the `safetensors` package (0.8 checked): `safe_open(framework="numpy")`
cannot return a bfloat16 tensor (numpy has no bfloat16; ml_dtypes, which JAX already needs, does),
and its "flax" framework returns each slice as a JAX array on the default device, where
`jax.make_array_from_callback` wants a host array per shard. A memmap slice reads only the bytes
a device's shard needs, and `read_header` checks what the format's specification asks (as the
package's own reader does), with messages naming the file, the tensor and the fix.
"""

from __future__ import annotations

import collections
import json
import math
import os
import struct
from typing import Any, Callable, Iterable, NamedTuple

import ml_dtypes
import numpy as np

from jaxscale.errors import JaxscaleError, json_object
from jaxscale.runtime.storage import reason, storage_error

DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header
_FIX = "re-download it or save it again with save_pretrained(safe_serialization=True)"
# For a file that cannot be opened or read (`storage_error` adds granting access to a refusal).
_READ_FIX = "check the path, or download the folder again"


class TensorInfo(NamedTuple):
    path: str  # the file that holds it
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file


def _damaged(path: str, what: str) -> JaxscaleError:
    return JaxscaleError(f"{path} is not a valid safetensors file: {what}; {_FIX}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a name given twice would let two readers see two different tensors."""
    repeated = sorted(name for name, n in collections.Counter(k for k, _ in pairs).items()
                      if n > 1)
    if repeated:
        raise ValueError(f"the header names {repeated[0]!r} twice")
    return dict(pairs)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON's true would pass as 1


def _read_json(path: str) -> tuple[dict, int, int]:
    """(the header, where the data section starts, its size in bytes); JaxscaleError when the
    file has no well-formed header that fits it."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise _damaged(path, f"{size} bytes, fewer than the 8 of the header length")
            (length,) = struct.unpack("<Q", prefix)
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise _damaged(path, f"its header length {length} does not fit the file's {size} "
                                     f"bytes (at most {min(_MAX_HEADER, size - 8)})")
            text = f.read(length)
    except OSError as e:  # missing or refused: exit 2; EIO, a timeout: 75
        raise storage_error(e, f"{path} cannot be read ({reason(e)})", _READ_FIX) from e
    try:
        header = json.loads(text, object_pairs_hook=_unique_keys)
    # Bad JSON, bad UTF-8 or a repeated name; RecursionError: arrays or objects nested deeper
    # than the parser recurses, which no real header is.
    except (ValueError, RecursionError) as e:
        raise _damaged(path, f"its header is not valid JSON ({e})") from None
    json_object(header, f"{path}: its header", _FIX)
    metadata = header.get("__metadata__", {})
    if not (isinstance(metadata, dict)
            and all(isinstance(v, str) for v in metadata.values())):
        raise _damaged(path, f"its __metadata__ {json.dumps(metadata)[:80]} is not an object of "
                             "strings")
    return header, 8 + length, size - 8 - length


def _check_entry(path: str, name: str, entry: Any) -> tuple[np.dtype, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry; JaxscaleError naming what is wrong."""
    where = f"tensor {name!r}"
    if not (isinstance(entry, dict) and {"dtype", "shape", "data_offsets"} <= entry.keys()):
        raise _damaged(path, f"{where} is {json.dumps(entry)[:80]}, not an object with dtype, "
                             "shape and data_offsets")
    dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise JaxscaleError(f"{path}: {where} has dtype {entry['dtype']!r}; jaxscale loads "
                            f"{sorted(DTYPES)}: save the weights in one of those")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)):
        raise _damaged(path, f"{where} has shape {shape!r}, not a list of sizes >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1]):
        raise _damaged(path, f"{where} has data_offsets {offsets!r}, not [begin, end] with "
                             "0 <= begin <= end")
    begin, end = offsets
    needed = math.prod(shape) * dtype.itemsize
    if end - begin != needed:
        raise _damaged(path, f"{where} {entry['dtype']} {shape} needs {needed} bytes but its "
                             f"data_offsets [{begin}, {end}] hold {end - begin}")
    return dtype, tuple(shape), begin, end


def read_header(path: str) -> dict[str, TensorInfo]:
    """{tensor name: where and what it is}, from the header alone, once every tensor's range is
    proven to lie in the data section, sized by its dtype and shape, the ranges tiling the section
    without overlaps or holes. JaxscaleError naming the file (and the tensor) otherwise, or when a
    tensor has a dtype jaxscale does not load."""
    header, start, data_size = _read_json(path)
    entries = {name: _check_entry(path, name, entry) for name, entry in header.items()
               if name != "__metadata__"}
    # Sorted by (begin, end): an empty tensor sorts before a tensor that starts where it does.
    covered, previous = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin < covered:
            raise _damaged(path, f"tensor {name!r} at bytes [{begin}, {end}) overlaps tensor "
                                 f"{previous!r}, which ends at {covered}")
        if begin > covered:
            raise _damaged(path, f"bytes [{covered}, {begin}) of the data section, before tensor "
                                 f"{name!r}, belong to no tensor (the format allows no holes)")
        if end > data_size:
            raise _damaged(path, f"tensor {name!r} ends at byte {end} of a data section of "
                                 f"{data_size} bytes (the file is truncated)")
        covered, previous = end, name
    if covered != data_size:
        raise _damaged(path, f"its data section has {data_size} bytes but its tensors cover "
                             f"{covered} (bytes after the last tensor belong to none)")
    return {name: TensorInfo(path, dtype, shape, start + begin)
            for name, (dtype, shape, begin, _) in entries.items()}


def read_slice(info: TensorInfo, view: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
    """A copy of `index` of the tensor reshaped to `view`, reading only the pages it touches.

    The map is unmapped when this returns (nothing else refers to it), so the pages read for
    one shard do not stay in this process's memory while the next is read.
    """
    try:
        mapped = np.memmap(info.path, dtype=info.dtype, mode="r", offset=info.offset,
                           shape=info.shape)
    except OSError as e:  # gone or refused since its header was read: exit 2; EIO: 75
        raise storage_error(e, f"{info.path} cannot be read ({reason(e)})",
                            _READ_FIX) from e
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
