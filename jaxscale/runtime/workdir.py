"""A run's workdir: checked before anything is written, opened once every check has passed.

    <workdir>/config.json      the config of the newest start
    <workdir>/metrics.jsonl    one JSON object per logging step (jaxscale.observe.metrics)
    <workdir>/tensorboard/     event files
    <workdir>/run.json         first start time and start count (jaxscale.observe.timing)
    <workdir>/checkpoints/     unless checkpoint.dir puts them elsewhere

Only process 0 writes these files; every process writes its own checkpoint shards.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import ml_collections

from jaxscale.cli import folder_flag
from jaxscale.config import default_config
from jaxscale.errors import ConfigError, json_object
from jaxscale.runtime.storage import (
    check_bucket,
    classified,
    filesystem,
    in_bucket,
    reason,
    storage_error,
    writing,
)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"  # train.sample_every's continuations, a line per sampling step
CONFIG_FILE = "config.json"
# The W&B / MLflow run a restart continues (jaxscale/observe/trackers.py).
TRACKER_RUN_ID_FILE = "tracker_run_id"
# The fix for a workdir file the storage refuses (a failing storage is retried, exit 75).
WORKDIR_FIX = "pass --workdir=<a folder you can write>"
# What a start from step 0 sets aside when an earlier start left them but no checkpoint: a fresh
# start then also opens a new tracker run rather than logging its steps again into the old one.
_EARLIER_START_FILES = (METRICS_FILE, SAMPLES_FILE, "tensorboard", "run.json",
                        TRACKER_RUN_ID_FILE)
def check_writable(path: str, what: str, fix: str) -> None:
    """ConfigError unless `path` is a folder, or could be created as one, that this process may
    write (TransientError when the storage fails to say). Leaves nothing behind: the probe is a
    file made and removed in the nearest folder that exists (permissions alone do not tell, e.g.
    for root or read-only mounts)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.path.islink(existing) and not os.path.exists(existing):
        # A link to nothing (an unmounted disk, a removed folder): creating the folder would fail
        # on it, and its parent being writable says nothing.
        raise ConfigError(f"{what} {path!r} cannot be written: {existing!r} is a symbolic link "
                          f"to {os.readlink(existing)!r}, which does not exist; {fix}")
    if not os.path.isdir(existing):
        raise ConfigError(f"{what} {path!r} cannot be written: {existing!r} is a file, not a "
                          f"folder; {fix}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxscale_write_probe_", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise storage_error(e, f"{what} {path!r} cannot be written ({reason(e)} in "
                               f"{existing!r})", fix) from None


def check_workdir(workdir: str) -> None:
    if not workdir.strip():
        raise ConfigError("workdir '' is empty; pass --workdir=DIR, the folder for the run's "
                          "metrics and checkpoints")
    if "://" in workdir:
        raise ConfigError(f"workdir {workdir!r} is a URL; the workdir is a local or mounted "
                          "folder. Put checkpoints in a bucket with "
                          "--config.checkpoint.dir=gs://...")
    check_writable(workdir, "workdir", WORKDIR_FIX)


def open_workdir(workdir: str, config_json: str) -> None:
    """Creates `workdir` and records the config this start runs with."""
    path = os.path.join(workdir, CONFIG_FILE)
    with writing(path, WORKDIR_FIX):
        os.makedirs(workdir, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(config_json)


_READ_FIX = "pass the workdir of a run this account can read"
_CONFIG_FIX = ("it is the run's config as jaxscale.train wrote it: restore it, or start the run "
               "again")


def folder_or_bucket_flag(text: str) -> str:
    """An argparse `type`: a folder that exists, or a bucket's (gs://, s3://: asked for when it
    is read, for the error the storage gives)."""
    return text if in_bucket(text) else folder_flag(text)


def read_config(workdir: str) -> ml_collections.ConfigDict:
    """The config the run in `workdir` last started with, over today's defaults (a key added
    since keeps its default); ConfigError when there is no such run."""
    path = os.path.join(workdir, CONFIG_FILE)
    if in_bucket(workdir):  # a workdir copied into a bucket is read there
        check_bucket(workdir, "--workdir")
    fs, inner = filesystem(path, "--workdir")
    with classified(f"cannot read {path!r}", _READ_FIX):
        try:
            read = fs.cat_file(inner)
        except (FileNotFoundError, IsADirectoryError):
            raise ConfigError(f"workdir {workdir!r} has no {CONFIG_FILE}; pass the workdir of a "
                              "run that python -m jaxscale.train has started") from None
    try:
        saved = json.loads(read)
    except ValueError as e:
        raise ConfigError(f"{path} is not JSON ({e}); {_CONFIG_FIX}") from None
    json_object(saved, path, _CONFIG_FIX, ConfigError)
    config = default_config()
    config.update(saved)
    return config


def logged_metrics(workdir: str) -> list[dict]:
    """Every line of `metrics.jsonl`, oldest first; [] when there is none."""
    path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(path):
        return []
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:  # a line torn by a killed process, or a blank one
                continue
            lines.append(json_object(value, f"{path} line {number}", "the run writes an object "
                                     "a line: remove that line"))
    return lines


def latest_metrics(workdir: str) -> dict:
    """The newest value of every metric the run has logged (its last train line merged with its
    last eval line, and so on), with `step` the newest step logged."""
    latest: dict = {}
    for line in logged_metrics(workdir):
        latest.update(line)
    return latest


def set_aside_earlier_start(workdir: str) -> str | None:
    """Moves the metrics, samples, TensorBoard files, run record and tracker run id of an earlier
    start that left no checkpoint into `<workdir>/earlier-<time>/`, so a run starting again from
    step 0 does not log the same steps twice into one file; returns that folder, or None when
    there was none."""
    found = [name for name in _EARLIER_START_FILES
             if os.path.exists(os.path.join(workdir, name))]
    if METRICS_FILE not in found:
        return None
    folder = os.path.join(workdir, f"earlier-{time.strftime('%Y%m%d-%H%M%S')}")
    with writing(folder, WORKDIR_FIX):
        os.makedirs(folder)
        for name in found:
            os.replace(os.path.join(workdir, name), os.path.join(folder, name))
    return folder
