"""One checkpoint folder: what it holds, and one agreed try at reading it back.

A checkpoint is the folder `<checkpoint dir>/<step>/` with four Orbax items, written and read
through the same handlers (`handler_registry`, with the items of `items_to_save`):

    params/  the trained parameters (with LoRA, the adapters: the base is named by the config's
             checkpoint.restore_from and not written again); every process writes its shards
    train/   the rest of the TrainState: step, optimizer state, loss scale
    fp8/     the fp8 matmuls' scales and amax histories; only in checkpoints of fp8 runs
    data/    iterator.json: the data iterator position of every process's row streams
    meta/    step, seed, config, productive seconds (for goodput)

The train step uses no random numbers: the seed, the step and the data position determine every
later step, so they are the run's whole RNG state.

A process-local checkpoint (the local tier, `checkpoint.local_dir`) holds the same items in a
folder of one process's own: that process writes every shard it holds (not only those of the
first replica) and the JSON items, with no other process taking part, and reads them back alone.
It restores onto the same shards only: `process_layout` names them, and the tier keeps each
layout's checkpoints apart. `holds_every_shard` says whether Orbax's writer covers them.

Reading one (`restore_once`) goes in agreed steps, each ending in a verdict (`verdict.py`): its
files are inspected for positive evidence of damage, its metadata read, its shapes checked
against the model's (ConfigError: the user's to resolve), then its arrays read. Every read and
stat raises its real error: a failing disk is no missing file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxscale.checkpoint.bucket_retries import bound_bucket_retries
from jaxscale.checkpoint.verdict import Damage, Outcome, Unavailable, Verdict, agreed
from jaxscale.errors import ConfigError, json_object
from jaxscale.models.fp8 import fresh_meta
from jaxscale.models.lora import ADAPTER_SUFFIX
from jaxscale.runtime.agreement import everyone

FP8_ITEM = "fp8"  # the item of TrainState.fp8, when the run has one
# A train state as the checkpoint sees it (jaxscale/training/state.py `TrainState`, whose module
# builds on this one): a NamedTuple whose `params` are the params item, `fp8` (None: none) the
# fp8 item, `frozen` (LoRA's base, named by the config) saved nowhere, the rest the train item.
State = Any
# Orbax's record of a step folder, written when the save starts and given `commit_timestamp_nsecs`
# when it finishes (every Orbax version this package supports, local folders and buckets alike).
_COMMIT_RECORD = "_CHECKPOINT_METADATA"
# Every save and read of a checkpoint comes through this module: a bucket failing holds neither
# longer than the bounded retries (bucket_retries.py).
bound_bucket_retries()


class ParamsOnly(NamedTuple):
    """The `State` of a params-only restore: the parameters' shapes, dtypes and shardings."""
    params: Any
    fp8: None = None


class Restored(NamedTuple):
    params: Any
    train: dict | None  # the TrainState's other fields; None for a params-only restore
    data_state: dict | None  # every row stream's data position; None for params only
    meta: dict
    path: str
    seconds: float


def restore_once(directory: epath.Path, step: int, abstract_state: State, *,
                 params_only: bool, process_local: bool = False) -> Outcome:
    """One agreed try at restoring checkpoint `step`: its files are inspected and its metadata
    read, then (once it is known to fit `abstract_state`) its items. Raises ConfigError when the
    checkpoint is sound but its shapes do not fit. With `process_local`, `directory` is this
    process's own (every process reads the same step from its own folder at once)."""
    path = directory / str(step)
    begin = time.perf_counter()
    # Inspected apart, before the reader: its barrier must be reached by every process or none.
    inspected = agreed(lambda: _inspect(path, params_only))
    if inspected.verdict is not Verdict.OK:
        return inspected
    with contextlib.ExitStack() as stack:
        def read_metadata() -> tuple[ocp.CheckpointManager, Any]:
            reader = stack.enter_context(_reader(directory, process_local))
            saved = reader.item_metadata(step)
            if not saved["params"] or not (params_only or saved["train"]):
                # Orbax reads None when `exists()` says False, as it does on a storage error;
                # `_inspect` has just read the files.
                raise Unavailable("Orbax read no array metadata, though _METADATA is there")
            return reader, saved
        found = agreed(read_metadata)
        if found.verdict is not Verdict.OK:
            return found
        reader, saved = found.value
        # Taking only the parameters (a fine-tuning start, LoRA's base, an export) reads them in
        # the reader's float dtype: LoRA keeps its frozen base in the compute dtype.
        _check_fits(saved["params"].tree, abstract_state.params, "parameter", path,
                    cast_floats=params_only)
        # An fp8 run reads the checkpoint's fp8 meta when it has some; a bfloat16 run never.
        with_fp8 = (not params_only and abstract_state.fp8 is not None
                    and saved.get(FP8_ITEM) is not None)
        if not params_only:
            _check_fits(saved["train"].tree, train_part(abstract_state), "train state entry",
                        path, cast_floats=True)
        if with_fp8:
            _check_fits(saved[FP8_ITEM].tree, abstract_state.fp8, "fp8 scale entry", path)
        read = agreed(lambda: reader.restore(step, args=_restore_args(
            abstract_state, params_only, with_fp8, process_local)))
    if read.verdict is not Verdict.OK:
        return read
    items = read.value
    train = None
    if not params_only:
        train = dict(items["train"])
        if abstract_state.fp8 is not None:
            # A checkpoint of a bfloat16 run: the scales start as a new run's do.
            train["fp8"] = items[FP8_ITEM] if with_fp8 else fresh_meta(abstract_state.fp8)
    return Outcome(Verdict.OK, value=Restored(
        params=items["params"], train=train,
        data_state=None if params_only else items["data"], meta=items["meta"], path=str(path),
        seconds=time.perf_counter() - begin))


def _inspect(path: epath.Path, params_only: bool) -> None:
    """Raises Damage with what proves checkpoint `path` damaged: its commit record missing, or
    saying the save never finished; an item's folder or metadata missing, or not JSON. A storage
    error reading them propagates as it is: it proves nothing. The arrays' bytes are checked by
    the reader itself, which needs them anyway (see `verdict.py`)."""
    record = _json_file(path, _COMMIT_RECORD)
    if record.get("commit_timestamp_nsecs") is None:
        raise Damage(f"{_COMMIT_RECORD} records no commit: its save never finished")
    metadata = {"params": ["_METADATA"], "meta": ["metadata"], "train": ["_METADATA"],
                "data": [_DataStateHandler.FILENAME, _DataStateHandler.EARLIER_FILENAME]}
    for item in ("params", "meta") if params_only else metadata:
        names = [f"{item}/{name}" for name in metadata[item]]
        present = [name for name in names if path_kind(path / name) == "file"]
        if not present:
            raise Damage(f"{names[0]} is missing")
        _json_file(path, present[0])


def _json_file(path: epath.Path, name: str) -> dict:
    """The JSON object in checkpoint `path`'s file `name` (every JSON file a save writes holds
    one); Damage when it is missing, not JSON or another JSON value."""
    try:
        value = json.loads((path / name).read_bytes())
    except FileNotFoundError:  # from open(): its real errno, unlike exists()
        raise Damage(f"{name} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Damage(f"{name} is not JSON ({e})") from None
    return json_object(value, name, error=Damage)


def _restore_args(abstract_state: State, params_only: bool, with_fp8: bool,
                  process_local: bool) -> ocp.args.Composite:
    def arrays(abstract: Any) -> ocp.args.CheckpointArgs:
        if process_local:
            return ocp.args.PyTreeRestore(
                abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        return ocp.args.StandardRestore(abstract)
    items = dict(params=arrays(abstract_state.params), meta=ocp.args.JsonRestore())
    if not params_only:
        items.update(train=arrays(train_part(abstract_state)), data=ocp.args.JsonRestore())
    if with_fp8:
        items[FP8_ITEM] = arrays(abstract_state.fp8)
    return ocp.args.Composite(**items)


def items_to_save(state: State, data_state: dict, meta: dict, *,
                  process_local: bool = False) -> ocp.args.Composite:
    """The items of a checkpoint of `state` (see the module's docstring)."""
    def arrays(tree: Any) -> ocp.args.CheckpointArgs:
        return ocp.args.PyTreeSave(tree) if process_local else ocp.args.StandardSave(tree)
    items = dict(params=arrays(state.params), train=arrays(train_part(state)),
                 data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta))
    if state.fp8 is not None:
        items[FP8_ITEM] = arrays(state.fp8)
    return ocp.args.Composite(**items)


def _check_fits(saved: Any, expected: Any, kind: str, path: epath.Path, *,
                cast_floats: bool = False) -> None:
    """Raises ConfigError naming the first entry whose shape or dtype differs, or that one side
    lacks. With `cast_floats`, floating-point entries may differ in dtype: Orbax casts them on
    restore (the optimizer moments, when `optim.moment_dtype` changed between starts)."""
    saved_leaves, expected_leaves = _leaves_by_name(saved), _leaves_by_name(expected)
    fix = ("resume with the config that wrote it, or train in a new workdir (with "
           "checkpoint.restore_from to start from it)")
    if kind == "parameter":
        _check_adapters(saved_leaves, expected_leaves, path)
    for name, want in expected_leaves.items():
        have = saved_leaves.get(name)
        if have is None:
            raise ConfigError(f"checkpoint {path} does not fit the model config: {kind} {name!r} "
                              f"is not in the checkpoint; {fix}")
        have_dtype, want_dtype = np.dtype(have.dtype), np.dtype(want.dtype)
        castable = cast_floats and all(jax.numpy.issubdtype(d, jax.numpy.floating)
                                       for d in (have_dtype, want_dtype))
        if tuple(have.shape) != tuple(want.shape) or (have_dtype != want_dtype and not castable):
            raise ConfigError(
                f"checkpoint {path} does not fit the model config: {kind} {name!r} is "
                f"{np.dtype(have.dtype).name}{list(have.shape)} in the checkpoint but "
                f"{np.dtype(want.dtype).name}{list(want.shape)} with this config; {fix}")
    extra = sorted(set(saved_leaves) - set(expected_leaves))
    if extra:
        raise ConfigError(f"checkpoint {path} does not fit the model config: it has {kind} "
                          f"{extra[0]!r}, which this config lacks; {fix}")


def _check_adapters(saved: dict[str, Any], expected: dict[str, Any], path: epath.Path) -> None:
    """ConfigError that says so when one side's parameters are LoRA adapters only (a LoRA run's
    checkpoint holds its adapters, not the frozen base) and the other's a whole model."""
    def adapters_only(leaves: dict[str, Any]) -> bool:
        return bool(leaves) and all(f"{ADAPTER_SUFFIX}/" in name for name in leaves)

    if adapters_only(saved) and not adapters_only(expected):
        name, leaf = next((n, x) for n, x in saved.items() if n.endswith("/a"))
        raise ConfigError(
            f"checkpoint {path} holds LoRA adapters (e.g. {name!r}, rank {leaf.shape[-1]}), not "
            "a whole model's parameters, and this config has model.lora off; to continue that "
            f"run, set model.lora.rank={leaf.shape[-1]} (and its targets) with its base as "
            "checkpoint.restore_from; to start from the adapted model, merge it first "
            "(python -m jaxscale.export_hf writes base and adapters as one model) and restore "
            "from that folder")
    if adapters_only(expected) and not adapters_only(saved):
        raise ConfigError(
            f"checkpoint {path} holds a whole model's parameters, and this config trains LoRA "
            "adapters (model.lora.rank > 0), whose checkpoints hold the adapters only; to "
            "fine-tune that model with LoRA, train in a new workdir with "
            f"checkpoint.restore_from={str(path)!r} (its base)")


def _leaves_by_name(tree: Any) -> dict[str, Any]:
    """{'a/b/0/c': leaf}: the same names for a State's NamedTuples and the dicts and lists
    Orbax reads back."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): leaf for p, leaf in leaves}


def train_part(state: State) -> dict:
    """Everything in a State but the params, the fp8 meta and LoRA's frozen base, saved as
    the `train` item: the same entries whatever precision.matmul, so checkpoints restore across
    it."""
    return {k: v for k, v in state._asdict().items() if k not in ("params", "fp8", "frozen")}


def handler_registry(process_local: bool = False
                     ) -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The handlers of a checkpoint's items; with `process_local`, those of a process-local one:
    every array shard this process holds, and the JSON items, written by this process alone."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    if process_local:
        alone = process_local_options()
        every_shard = ocp.type_handlers.create_type_handler_registry((
            jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None,
                                                      use_replica_parallel=False)))
        arrays = ocp.PyTreeCheckpointHandler(multiprocessing_options=alone,
                                             type_handler_registry=every_shard)
        array_args = (ocp.args.PyTreeSave, ocp.args.PyTreeRestore)
        json_handler, data_state = (ocp.JsonCheckpointHandler(multiprocessing_options=alone),
                                    _DataStateHandler(multiprocessing_options=alone))
    else:
        arrays, array_args = None, (ocp.args.StandardSave, ocp.args.StandardRestore)
        json_handler, data_state = None, _DataStateHandler()
    for item in ("params", "train", FP8_ITEM):
        for args in array_args:
            registry.add(item, args, arrays)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
        registry.add("data", args, data_state)
        registry.add("meta", args, json_handler)
    return registry


def process_local_options() -> ocp.options.MultiprocessingOptions:
    """Orbax's options for a manager or handler that this process uses alone: no barrier with the
    others, every file of its own written by itself."""
    process = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=None, active_processes={process},
                                              barrier_sync_key_prefix=f"process_{process}")


def process_layout(state: Any) -> str:
    """A name for the shards of `state` (arrays or their abstract shapes) that this process holds:
    the same for the same processes, shapes and shardings, so a process-local checkpoint restores
    where the reader needs exactly the shards it holds (a shard it lacks would read as zeros)."""
    lines = [f"process {jax.process_index()} of {jax.process_count()}"]
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        sharding = getattr(leaf, "sharding", None)
        shape = tuple(leaf.shape)
        held = "host" if sharding is None else sorted(
            {tuple(s.indices(n)[:2] for s, n in zip(index, shape))
             for index in sharding.addressable_devices_indices_map(shape).values()})
        lines.append(f"{jax.tree_util.keystr(path)} {shape} {held}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def holds_every_shard(state: Any) -> bool:
    """Whether Orbax's process-local writer, which writes the shards of one replica (the first
    shard's), writes every shard this process holds of `state`'s arrays. A process that holds one
    replica of some shards and another of others would restore the rest as zeros."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            shards = leaf.addressable_shards
            def held(chosen):
                return {tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape))
                        for shard in chosen}
            first = [s for s in shards if s.replica_id == shards[0].replica_id]
            if held(first) != held(shards):
                return False
    return True


def holds_whole_arrays(state: Any) -> bool:
    """Whether this process holds every array of `state` whole (its shards together cover each
    array: a full replica, as in data parallelism across processes). Its process-local
    checkpoint then restores onto any layout, by this process alone."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array):
            boxes = {tuple(s.indices(n)[:2] for s, n in zip(shard.index, leaf.shape))
                     for shard in leaf.addressable_shards}
            # The shards of one sharding are equal boxes that never overlap unless equal.
            if sum(math.prod(stop - start for start, stop in box) for box in boxes) != leaf.size:
                return False
    return True


class _DataStateHandler(ocp.handlers.JsonCheckpointHandler):
    """The data iterator's position: `Input.get_state()` already holds every process's row
    streams, so process 0 writes it once and every process reads that file. Checkpoints written
    before this layout have one identical `process_<i>.json` per process; they read
    `process_0.json`."""

    FILENAME = "iterator.json"
    EARLIER_FILENAME = "process_0.json"

    def __init__(self, **options: Any):
        super().__init__(self.FILENAME, **options)

    def restore(self, directory: epath.Path, item: Any = None, args: Any = None) -> dict:
        # `path_kind`, not `exists()`: a storage error must not send the reader to the earlier file.
        if path_kind(directory / self.FILENAME) is None:
            return json.loads((directory / self.EARLIER_FILENAME).read_text())
        return super().restore(directory, item, args)


def _reader(directory: epath.Path, process_local: bool = False) -> ocp.CheckpointManager:
    """A manager that only reads `directory`: it creates, cleans up and deletes nothing. With
    `process_local`, a folder of this process's own, read with no other process."""
    with _quiet_read_only_notice():
        return ocp.CheckpointManager(
            directory, handler_registry=handler_registry(process_local),
            options=ocp.CheckpointManagerOptions(
                read_only=True, create=False, save_interval_steps=0,
                **({"multiprocessing_options": process_local_options()} if process_local
                   else {})))


@contextlib.contextmanager
def _quiet_read_only_notice():
    """Orbax warns that a read-only manager's folder "is read only" (it is, on purpose); every
    resume would print it."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")

    absl_logger = logging.getLogger("absl")
    absl_logger.addFilter(keep)
    try:
        yield
    finally:
        absl_logger.removeFilter(keep)


def path_kind(path: epath.Path) -> str | None:
    """"dir", "file", or None when nothing is at `path`. Unlike `exists()` (os.path.exists says
    False whatever the error), a storage error propagates: a failing disk is no missing folder."""
    try:
        return "dir" if path.stat().is_directory else "file"
    except (FileNotFoundError, NotADirectoryError):
        return None


def finalized_steps(directory: epath.Path) -> Outcome:
    """The steps Orbax lists as complete in `directory`, oldest first ([] without the folder),
    agreed. Whether the folder is there is agreed first: Orbax's reader waits at a barrier that
    every process must reach, or none. Processes that see the folder differently see a storage
    that is not consistent yet: UNAVAILABLE (tried again, then exit 75), not a run from scratch."""
    found = agreed(lambda: path_kind(directory) is not None)
    if found.verdict is not Verdict.OK:
        return found._replace(value=[])
    seen = everyone(found.value)
    if not seen.any():
        return found._replace(value=[])
    if not seen.all():
        return Outcome(Verdict.UNAVAILABLE, f"processes {np.flatnonzero(seen).tolist()} see the "
                                            f"folder, processes {np.flatnonzero(~seen).tolist()} "
                                            "do not")
    with contextlib.ExitStack() as stack:
        return agreed(lambda: list(stack.enter_context(_reader(directory)).all_steps()))


def own_steps(directory: epath.Path) -> list[int]:
    """The steps Orbax lists as complete in `directory`, a folder of this process's own (the
    local tier), oldest first; [] without the folder. A storage error is raised as it is."""
    if path_kind(directory) is None:
        return []
    with _reader(directory, process_local=True) as reader:
        return sorted(reader.all_steps())
