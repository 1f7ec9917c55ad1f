"""Hugging Face weights <-> jaxscale parameters, for any family: each parameter is the tensor its
family's `hf_tensors` names (jaxscale/models/hf_layout.py says how they correspond).

Loading is sharded: every parameter is made by `jax.make_array_from_callback`, which asks for
the slices this process's devices hold, and each slice is read from a memory map of the file,
so no process reads (or holds) more than its devices' part, one tensor at a time.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxscale.errors import JaxscaleError, json_object
from jaxscale.hf import safetensors
from jaxscale.hf.config import INDEX_FILE, SINGLE_FILE
from jaxscale.models.decoder import DecoderConfig
from jaxscale.models.hf_layout import HfTensor
from jaxscale.models.spec import family_module
from jaxscale.runtime.storage import reason, storage_error

SHARD_BYTES = 5_000_000_000  # transformers' save_pretrained default, "5GB"
DTYPES = ("float32", "bfloat16", "float16")
# Tensors a Hugging Face file may hold that jaxscale has no parameter for: non-persistent RoPE
# buffers saved by old transformers versions.
_IGNORED_SUFFIX = ".rotary_emb.inv_freq"


def layout(cfg: DecoderConfig) -> list[HfTensor]:
    """Every parameter of `cfg`'s model as its family names it in a Hugging Face folder."""
    return family_module(cfg.family).hf_tensors(cfg)


# -- loading ---------------------------------------------------------------------------------

_INDEX_FIX = "it needs a weight_map object of {tensor name: file name}; re-download it"


def read_weight_map(index_file: str) -> dict[str, str]:
    """The index's {tensor name: file name}; JaxscaleError when it is not an index whose file
    names stay inside its folder.

    Names are checked as written (relative, no `..` climbing out), not through symlinks: a
    Hugging Face cache snapshot links every file to a blob outside the folder, and whoever can put
    a symlink in the folder could as well put its bytes there."""
    try:
        with open(index_file, encoding="utf-8") as f:
            index = json.load(f)
    except OSError as e:  # refused: exit 2; EIO, a timeout: 75
        raise storage_error(e, f"{index_file} cannot be read ({reason(e)})",
                            "check the path, or download the folder again") from e
    # Bad JSON or bad UTF-8; RecursionError: nested deeper than the parser recurses.
    except (ValueError, RecursionError) as e:
        raise JaxscaleError(f"{index_file} is not a safetensors index (not JSON: {e}); "
                            "re-download it") from None
    weight_map = json_object(index, index_file, _INDEX_FIX).get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(file, str) for file in weight_map.values())):
        raise JaxscaleError(f"{index_file} is not a safetensors index: {_INDEX_FIX}")
    for name, file in weight_map.items():
        normal = os.path.normpath(file)
        if os.path.isabs(file) or normal == os.pardir or normal.startswith(os.pardir + os.sep):
            raise JaxscaleError(f"{index_file} puts tensor {name!r} in {file!r}, outside its "
                                "folder; an index names files inside its own folder: "
                                "re-download it")
    return weight_map


def _is_file(path: str) -> bool:
    """Whether a file is at `path`. Unlike `os.path.isfile` (False whatever the error), a storage
    error propagates as one (75, or 2 when refused): a failing disk is no missing file."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:
        raise storage_error(e, f"{path} cannot be read ({reason(e)})",
                            "check the path, or download the folder again") from e


def tensor_index(path: str) -> dict[str, safetensors.TensorInfo]:
    """Every tensor in the folder's safetensors file(s), from their headers only."""
    index_file = os.path.join(path, INDEX_FILE)
    if _is_file(index_file):
        weight_map = read_weight_map(index_file)
        files = sorted(set(weight_map.values()))
    elif _is_file(os.path.join(path, SINGLE_FILE)):
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise JaxscaleError(f"{path!r} has neither {SINGLE_FILE} nor {INDEX_FILE}; jaxscale "
                            "loads safetensors weights (save them with save_pretrained)")
    tensors = {}
    for name in files:
        file = os.path.join(path, name)
        if not _is_file(file):
            raise JaxscaleError(f"{index_file} names the shard {name!r}, which is missing from "
                                f"{path!r}; download every shard the index lists")
        for tensor, info in safetensors.read_header(file).items():
            if tensor in tensors:  # which one is meant? transformers takes either
                raise JaxscaleError(f"tensor {tensor!r} is in both {tensors[tensor].path} and "
                                    f"{file}; a folder holds each tensor once: re-download it")
            tensors[tensor] = info
    if weight_map is not None:
        misplaced = sorted(t for t, name in weight_map.items()
                           if t not in tensors or tensors[t].path != os.path.join(path, name))
        if misplaced:
            raise JaxscaleError(f"{index_file} puts {misplaced[0]!r} in "
                                f"{weight_map[misplaced[0]]!r}, which does not hold it; "
                                "re-download that shard")
    return tensors


def check_tensors(cfg: DecoderConfig, tensors: dict[str, safetensors.TensorInfo],
                  path: str) -> None:
    """JaxscaleError naming the first tensor that is missing, has another shape than `cfg`
    needs, or that `cfg`'s model has no place for."""
    expected = {}
    for t in layout(cfg):
        expected.update(dict.fromkeys(t.names(cfg.n_layers), t.hf_shape))
    for name, shape in expected.items():
        if name not in tensors:
            raise JaxscaleError(f"{path!r} has no tensor {name!r}, which the model config needs "
                                "(tie_embeddings=False needs lm_head.weight); use the folder's "
                                "own config.json")
        if tensors[name].shape != shape:
            raise JaxscaleError(
                f"tensor {name!r} in {tensors[name].path} is {list(tensors[name].shape)} but the "
                f"model config needs {list(shape)}; the weights do not match config.json")
    tied_head = "lm_head.weight" if cfg.tie_embeddings else None  # tied: the embedding is used
    extra = sorted(n for n in tensors
                   if n not in expected and n != tied_head and not n.endswith(_IGNORED_SUFFIX))
    if extra:
        raise JaxscaleError(f"tensor {extra[0]!r} in {tensors[extra[0]].path} has no place in "
                            f"jaxscale's {cfg.family} (biases or another architecture?); only "
                            f"the weights of a plain {cfg.family} load")


def _reader(tensor: HfTensor, infos: list[safetensors.TensorInfo], shape: tuple[int, ...],
            dtype: np.dtype):
    """`make_array_from_callback`'s callback for one parameter of global `shape`: the requested
    slice, read file tensor by file tensor (one per layer, or per layer and expert: `infos` in
    `HfTensor.names` order), with the padding (vocabulary rows past the file's) zero."""
    lead = len(shape) - len(tensor.view)  # the stacked axes: layers, then experts
    one_shape = shape[lead:]  # padded
    ours = tuple(tensor.view[p] for p in tensor.perm)  # unpadded
    inverse = np.argsort(tensor.perm)

    def one_tensor(info, index):
        bounds = [s.indices(n)[:2] for s, n in zip(index, one_shape)]
        out = np.zeros([stop - start for start, stop in bounds], dtype)
        in_file = [slice(min(start, m), min(stop, m)) for (start, stop), m in zip(bounds, ours)]
        block = safetensors.read_slice(info, tensor.view, tuple(in_file[i] for i in inverse))
        block = block.transpose(tensor.perm)
        out[tuple(slice(0, n) for n in block.shape)] = block
        return out

    def read(index: tuple[slice, ...]) -> np.ndarray:
        ranges = [range(*s.indices(n)) for s, n in zip(index[:lead], shape[:lead])]
        blocks = [one_tensor(infos[int(np.ravel_multi_index(at, shape[:lead]))], index[lead:])
                  for at in itertools.product(*ranges)]
        if not lead:
            return blocks[0]
        return np.stack(blocks).reshape(*map(len, ranges), *blocks[0].shape)

    return read


def load_params(path: str, cfg: DecoderConfig, abstract_params: Any) -> Any:
    """The folder's weights as a params tree shaped like `abstract_params` (ShapeDtypeStructs
    with shardings: each array is born with its sharding and dtype). Reads only the tensor slices
    this process's devices hold. JaxscaleError (before anything is read but headers) when the
    files do not match `cfg`."""
    tensors = tensor_index(path)
    check_tensors(cfg, tensors, path)
    params = jax.tree.map(lambda x: x, abstract_params)  # a copy to fill in
    for t in layout(cfg):
        node = params
        for key in t.path[:-1]:
            node = node[key]
        want = node[t.path[-1]]
        infos = [tensors[name] for name in t.names(cfg.n_layers)]
        node[t.path[-1]] = jax.make_array_from_callback(
            want.shape, want.sharding, _reader(t, infos, want.shape, np.dtype(want.dtype)))
    return params


# -- saving ----------------------------------------------------------------------------------

def to_host(array: jax.Array) -> np.ndarray:
    """The whole array on this host (gathered from the other processes when they hold parts)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def save_params(params: Any, cfg: DecoderConfig, path: str, dtype: str,
                shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Writes the params as safetensors files in `path` (an existing folder), sharded like
    save_pretrained; returns the file names. Every process must call it (a parameter split over
    processes is gathered); process 0 writes."""
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    tensors = {}  # hf name -> (Tensor, its place along the stacked axes: layers, experts)
    for t in layout(cfg):
        for index, name in zip(t.indices(cfg.n_layers), t.names(cfg.n_layers)):
            tensors[name] = (t, index)

    def produce(name: str) -> np.ndarray:
        t, index = tensors[name]
        array = params
        for key in t.path:
            array = array[key]
        ours = to_host(array[index] if index else array)
        unpadded = ours[tuple(slice(0, n) for n in (t.view[p] for p in t.perm))]
        return unpadded.transpose(np.argsort(t.perm)).reshape(t.hf_shape).astype(np_dtype)

    sizes = [(name, math.prod(t.hf_shape) * np_dtype.itemsize) for name, (t, _) in
             tensors.items()]
    shards = safetensors.plan_shards(sizes, shard_bytes)
    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    writer = jax.process_index() == 0
    for file, names in zip(files, shards):
        shapes = [tensors[name][0].hf_shape for name in names]
        if writer:
            safetensors.write(os.path.join(path, file), names, shapes, np_dtype, produce)
        else:  # take part in the gathers process 0 makes
            for name in names:
                produce(name)
    if writer and len(files) > 1:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        with open(os.path.join(path, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": sum(size for _, size in sizes)},
                       "weight_map": weight_map}, f, indent=2)
    return files
