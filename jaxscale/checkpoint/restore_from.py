"""Starting from elsewhere (`checkpoint.restore_from`): another run's checkpoint (a workdir, its
checkpoints folder or one step folder, local or in a bucket) or a Hugging Face model folder, read
and never written. The trainer starts a new run from it; the sampler, `export_hf` and a LoRA
run's frozen base read from it alone (`restore_params`, `lora_base`, `saved_steps`). This run's
own checkpoints, their tiers and resuming them are manager.py's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import ml_collections
from etils import epath
from flax import nnx

from jaxscale.checkpoint.manager import CHECKPOINT_SUBDIR, check_checkpoint_bucket
from jaxscale.checkpoint.reading import (
    ParamsOnly,
    Restored,
    State,
    finalized_steps,
    path_kind,
    restore_once,
)
from jaxscale.checkpoint.verdict import Verdict, agreed, raise_unless_ok, retrying
from jaxscale.errors import JaxscaleError
from jaxscale.hf.bucket_folder import local_folder
from jaxscale.hf.config import is_hf_folder, shape_mismatch
from jaxscale.hf.weights import load_params
from jaxscale.models.decoder import DecoderConfig
from jaxscale.models.spec import ModelSpec, create_model
from jaxscale.runtime.storage import in_bucket, reason, storage_error


def restore_from(path: str, abstract_state: State, *, params_only: bool,
                 model_config: DecoderConfig) -> Restored:
    """Another run's checkpoint (`checkpoint.restore_from`): a workdir, its checkpoint folder or
    one step folder; or a Hugging Face model folder, whose weights are the params (params only,
    whatever `params_only` says: it has nothing else). Nothing in it is written. Raises
    JaxscaleError when it is no checkpoint or a damaged one, TransientError when the storage does
    not deliver it."""
    if is_hf_folder(path, "checkpoint.restore_from"):
        local = local_folder(path, "checkpoint.restore_from")  # a bucket's, copied
        if mismatch := shape_mismatch(local, model_config):  # the folder is whole; the config not
            raise JaxscaleError(
                f"checkpoint.restore_from={path!r} is a Hugging Face model of another shape than "
                f"the config's model: its config.json has {mismatch}; start from "
                f"--config=configs/hf.py:{path} (the model taken from the folder), or set "
                "those model keys to the folder's")
        begin = time.perf_counter()
        params = load_params(local, model_config, abstract_state.params)
        return Restored(params=params, train=None, data_state=None, meta={"step": 0},
                        path=path if in_bucket(path) else os.path.abspath(path),
                        seconds=time.perf_counter() - begin)
    what = f"checkpoint.restore_from={path!r}"
    located = retrying(lambda: agreed(lambda: _locate(path)), what)
    raise_unless_ok(located, what)
    directory, step = located.value
    if step is None:
        listing = retrying(lambda: finalized_steps(directory), what)
        raise_unless_ok(listing, what)
        if not listing.value:
            raise JaxscaleError(f"{what}: {directory} holds no finished checkpoint (only folders "
                                "of saves that never finished); point it at another run")
        step = listing.value[-1]
    outcome = retrying(lambda: restore_once(directory, step, abstract_state,
                                            params_only=params_only), what)
    if outcome.verdict is Verdict.DAMAGED:
        raise JaxscaleError(f"{what}: checkpoint {directory / str(step)} is damaged "
                            f"({outcome.problem}); point checkpoint.restore_from at another of "
                            "its checkpoints")
    raise_unless_ok(outcome, what)
    return outcome.value


def restore_params(path: str, abstract_params: Any, model_config: DecoderConfig) -> Restored:
    """`restore_from` of the parameters alone, read into `abstract_params` (shapes, dtypes and
    shardings; with LoRA, the adapters or the base, whichever the caller wants)."""
    return restore_from(path, ParamsOnly(abstract_params), params_only=True,
                        model_config=model_config)


def lora_base(config: ml_collections.ConfigDict, spec: ModelSpec,
              abstract_frozen: Any) -> tuple[Any, str]:
    """(the frozen base that a LoRA run's adapters are trained on, what it is), laid out as
    `abstract_frozen` (shapes, dtypes, shardings): `checkpoint.restore_from`'s parameters (a
    Hugging Face folder or a run), else the init of `train.seed`. That init is made with the
    adapters, as the run made it: they draw from the same random stream as the base."""
    if config.checkpoint.restore_from:
        restored = restore_params(config.checkpoint.restore_from, abstract_frozen, spec.config)
        return restored.params, restored.path

    def init():
        params = nnx.to_pure_dict(nnx.state(create_model(spec.config, config.train.seed),
                                            nnx.Param))
        return jax.tree.map(lambda x, a: x.astype(a.dtype), spec.frozen(params), abstract_frozen)

    shardings = jax.tree.map(lambda a: a.sharding, abstract_frozen)
    return jax.jit(init, out_shardings=shardings)(), f"the init of train.seed={config.train.seed}"


def saved_steps(directory: str | epath.Path) -> list[int]:
    """The steps with a checkpoint (a step folder holding params) in `directory`, local or a
    bucket (gs://...), oldest first; [] when there is no such folder. A failing disk is no empty
    folder: TransientError (exit 75), or ConfigError when access is refused."""
    directory = epath.Path(directory)
    try:
        if path_kind(directory) != "dir":
            return []
        return sorted(int(p.name) for p in directory.iterdir()
                      if p.name.isdigit() and path_kind(p / "params") == "dir")
    except OSError as e:
        raise storage_error(e, f"cannot list the checkpoints in {directory} ({reason(e)})",
                            "check the storage, then run again") from e


def _locate(path: str) -> tuple[epath.Path, int | None]:
    """(checkpoint folder, step or None for the newest) for a `restore_from` path."""
    hint = ("point checkpoint.restore_from at a run's workdir, its checkpoints/ folder, one "
            "step folder in it, or a Hugging Face model folder")
    if "://" in path:
        check_checkpoint_bucket(path, "checkpoint.restore_from")
    # Orbax needs absolute paths; a URL (gs://...) is absolute already.
    given = epath.Path(path if "://" in path else os.path.abspath(path))
    kind = path_kind(given)
    if kind is None:
        raise JaxscaleError(f"checkpoint.restore_from={path!r} does not exist; {hint}")
    if kind == "file":
        raise JaxscaleError(f"checkpoint.restore_from={path!r} is a file, not a checkpoint; {hint}")
    if path_kind(given / CHECKPOINT_SUBDIR) == "dir":
        given = given / CHECKPOINT_SUBDIR
    if given.name.isdigit() and path_kind(given / "params") == "dir":
        return given.parent, int(given.name)
    if saved_steps(given):
        return given, None
    raise JaxscaleError(f"checkpoint.restore_from={path!r} holds no jaxscale checkpoint; {hint}")
