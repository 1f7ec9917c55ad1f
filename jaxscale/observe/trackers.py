"""The places a run's metrics go besides the console, chosen by `metrics.trackers`:

    jsonl        <workdir>/metrics.jsonl, one JSON object per logging step (on by default)
    tensorboard  <workdir>/tensorboard/ event files (on by default)
    wandb        a Weights & Biases run (pip install 'jaxscale[wandb]')
    mlflow       an MLflow run (pip install 'jaxscale[mlflow]')

Each gets the same metrics at the same steps: a train metric `loss` is `loss` in the JSON line and
`train/loss` elsewhere, an eval metric `eval_loss` and `eval/loss`. A vector metric (an MoE
layer's per-expert load) is a list in the JSON line, a histogram over its index in TensorBoard and
W&B, and one metric per element in MLflow (`train/moe_expert_load/0`, ...), which has no vectors.
W&B and MLflow also record the config, flattened to dotted keys (`train.steps`).

A workdir has one tracker run id (<workdir>/tracker_run_id): a restarted run continues the same
W&B run (the id is its run id) and the same MLflow run (found by its `jaxscale_run_id` tag).
W&B and MLflow are imported only when chosen; `check_trackers` imports them at start-up, so a
missing package, or an environment variable of theirs that they refuse (WANDB_MODE=cloud), is a
one-line error before anything is written. `check_tracker_access`, also before anything is
written, makes sure each chosen tracker can be opened: an MLflow file store's folder can be
written, an MLflow URI has a scheme MLflow knows (else exit 2), an MLflow server and W&B's answer
within `TRACKER_TIMEOUT_S` (else exit 75), and online W&B has a key (else exit 2).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import math
import os
import secrets
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import NoReturn, Protocol

import ml_collections
import numpy as np
import tensorboardX

from jaxscale.errors import ConfigError, TransientError
from jaxscale.observe.bucket_events import register_bucket_writers
from jaxscale.runtime.storage import check_bucket, in_bucket, writing
from jaxscale.runtime.workdir import SAMPLES_FILE, TRACKER_RUN_ID_FILE, WORKDIR_FIX, check_writable

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
# Each is also the module the tracker imports and the jaxscale extra that installs it.
_OPTIONAL = ("wandb", "mlflow")
WANDB_MODES = ("", "online", "offline")
# MLflow refuses (2.x) or truncates with a warning (3.x) a param value longer than this: a long
# config value (data.sources) is cut here instead, the same way in every version.
_MLFLOW_PARAM_LIMIT = 6000
_MLFLOW_RUN_ID_TAG = "jaxscale_run_id"
# A tracking server takes at most 100 params in one batch request (the config has more keys).
_MLFLOW_PARAMS_PER_BATCH = 100
# How long a tracker's server has to answer at start-up: MLflow's own retries of an unreachable
# server take 253 s, W&B's longer. Past it the run stops with exit 75, before writing anything.
TRACKER_TIMEOUT_S = 30.0
# MLflow's error codes that say the server refused this user: the user's to fix, not retried.
_MLFLOW_REFUSALS = ("PERMISSION_DENIED", "UNAUTHENTICATED")

# One tracker's view of a logged step: names without the prefix, each value a number or a list.
Metrics = dict[str, float | int | list[float]]


class Tracker(Protocol):
    def write(self, step: int, metrics: Metrics, prefix: str) -> None: ...

    def write_samples(self, step: int, samples: dict[str, str]) -> None:
        """`samples`: prompt -> the model's continuation (train.sample_every)."""

    def close(self, failed: bool) -> None: ...


def check_trackers(config: ml_collections.ConfigDict) -> None:
    """ConfigError for an unknown tracker, a bad W&B mode, or a chosen tracker whose package is
    missing (imported here, so the error comes before anything is written)."""
    m = config.metrics
    names = m.trackers
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"metrics.trackers={names!r} must be a tuple of tracker names, e.g. "
                          "('jsonl', 'tensorboard', 'mlflow')")
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"metrics.trackers includes {name!r}, which is unknown; use any of "
                              f"{TRACKERS}, as a tuple: --config.metrics.trackers=\"('jsonl',"
                              "'mlflow')\"")
    if len(set(names)) < len(names):
        raise ConfigError(f"metrics.trackers={tuple(names)!r} names a tracker twice; name each "
                          "once")
    if m.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"metrics.wandb_mode={m.wandb_mode!r} is unknown; use one of "
                          f"{WANDB_MODES} ('': the WANDB_MODE environment variable, else online)")
    for name in [n for n in names if n in _OPTIONAL]:
        try:
            importlib.import_module(name)
        except ImportError as e:
            why = "is not installed" if e.name == name else f"failed to import ({e})"
            raise ConfigError(f"metrics.trackers includes {name!r} but the {name} package {why}; "
                              f"pip install 'jaxscale[{name}]'") from None
        _check_environment(name)


def _check_environment(name: str) -> None:
    """ConfigError for an environment variable of the tracker library `name` that the library
    itself refuses: it reads them when the run opens it, after the workdir is written. Each is
    parsed by the library's own code, so the accepted values are always the installed
    version's."""
    if name == "wandb":
        import wandb
        from pydantic import ValidationError  # W&B's settings are a pydantic model

        for variable, value in sorted(os.environ.items()):
            if variable.startswith("WANDB_"):
                try:  # one variable at a time, on fresh settings: the error names the one refused
                    wandb.Settings().update_from_env_vars({variable: value})
                except ValidationError as e:
                    _refused(variable, value, name, e.errors()[0]["msg"])
    else:
        from mlflow import environment_variables

        for variable, value in sorted(os.environ.items()):
            declared = getattr(environment_variables, variable, None)
            # MLflow's declared variables; each parses its own value on get().
            if isinstance(declared, environment_variables._EnvironmentVariable):
                try:
                    declared.get()
                except ValueError as e:
                    _refused(variable, value, name, str(e))


def _refused(variable: str, value: str, name: str, why: str) -> NoReturn:
    raise ConfigError(f"the environment variable {variable}={value!r}, which {name} reads, is "
                      f"refused by it ({' '.join(why.split())[:300]}); fix or unset {variable}")


def check_tracker_access(config: ml_collections.ConfigDict, workdir: str) -> None:
    """ConfigError or TransientError unless every chosen tracker can be opened, found without
    writing anything: JSONL writes in the workdir (checked with it), TensorBoard there too
    unless metrics.tensorboard_dir names another folder (checked here) or a bucket (asked for);
    an MLflow file store's folder must be writable; an MLflow server must answer, W&B online must
    have a key and its server answer, each within TRACKER_TIMEOUT_S. Process 0 only."""
    names = config.metrics.trackers
    if "tensorboard" in names and config.metrics.tensorboard_dir:
        folder, fix = config.metrics.tensorboard_dir, "set metrics.tensorboard_dir to a folder " \
            "or bucket folder you can write, or leave it empty (<workdir>/tensorboard)"
        if in_bucket(folder):
            check_bucket(folder, "metrics.tensorboard_dir")
        else:
            check_writable(folder, "metrics.tensorboard_dir", fix)
    if "mlflow" in names:
        uri = _mlflow_uri(config, workdir)
        parsed = urllib.parse.urlparse(uri)
        if parsed.scheme in ("", "file"):  # a file store: a folder (a bare path is one too)
            check_writable(parsed.path if parsed.scheme else uri, "the MLflow tracking URI's "
                           "folder", "set metrics.mlflow_tracking_uri (or MLFLOW_TRACKING_URI) "
                           "to a folder you can write, or to a tracking server")
        else:
            _within(TRACKER_TIMEOUT_S, f"the MLflow tracking server {uri}",
                    lambda: _mlflow_answers(uri))
    if "wandb" in names and _wandb_mode(config) == "online":
        import wandb  # an optional dependency: imported only when chosen

        # W&B reads the environment into its settings once, here: the run gets the user's
        # settings, not the wait set below.
        wandb.setup()
        # W&B waits WANDB_HTTP_TIMEOUT s (10 unless set) for its server to check a key, and
        # reports no answer as a refused key; made to wait longer than the check does, what comes
        # back in time is the server's own answer.
        users = os.environ.get("WANDB_HTTP_TIMEOUT")
        os.environ["WANDB_HTTP_TIMEOUT"] = str(math.ceil(TRACKER_TIMEOUT_S) + 1)
        try:
            _within(TRACKER_TIMEOUT_S, "W&B's server", _wandb_logged_in)
        finally:
            if users is None:
                del os.environ["WANDB_HTTP_TIMEOUT"]
            else:
                os.environ["WANDB_HTTP_TIMEOUT"] = users


def _within(seconds: float, what: str, probe) -> None:
    """Runs `probe()` on a thread of its own; TransientError when it has not returned after
    `seconds`. A daemon thread, left to finish on its own: the run is stopping, and a pool's
    worker would be joined at exit, holding the process for as long as the server does not
    answer."""
    outcome: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            probe()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            outcome.set_exception(e)
        else:
            outcome.set_result(None)

    threading.Thread(target=run, name="tracker-probe", daemon=True).start()
    try:
        outcome.result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise TransientError(f"{what} did not answer within {seconds:g} s") from None


def _mlflow_answers(uri: str) -> None:
    """Asks the tracking server for one experiment: ConfigError when MLflow cannot open `uri` or
    the server refuses this user, TransientError when it cannot be reached or fails."""
    from mlflow.exceptions import MlflowException  # an optional dependency: chosen only
    from mlflow.tracking import MlflowClient

    try:  # no request yet: a URI MLflow refuses here is one no server could ever answer
        client = MlflowClient(uri)
    except MlflowException as e:
        raise ConfigError(f"the MLflow tracking URI {uri!r} is not one MLflow can open "
                          f"({' '.join(str(e).split())[:300]}); set metrics.mlflow_tracking_uri "
                          "(or MLFLOW_TRACKING_URI) to a tracking server's http(s)://HOST:PORT, "
                          "a folder, or file://PATH") from None
    try:
        client.search_experiments(max_results=1)
    except MlflowException as e:
        words = " ".join(str(e).split())[:300]
        if e.error_code in _MLFLOW_REFUSALS:
            raise ConfigError(f"the MLflow tracking server {uri} refused this user ({words}); "
                              "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                              "MLFLOW_TRACKING_TOKEN), or another metrics.mlflow_tracking_uri") \
                from None
        raise TransientError(f"the MLflow tracking server {uri} failed ({words})") from None
    except OSError as e:  # requests' ConnectionError and timeouts, when MLflow lets them through
        raise TransientError(f"the MLflow tracking server {uri} could not be reached "
                             f"({' '.join(str(e).split())[:300]})") from None


def _wandb_mode(config: ml_collections.ConfigDict) -> str:
    return config.metrics.wandb_mode or os.environ.get("WANDB_MODE") or "online"


def _wandb_logged_in() -> None:
    """ConfigError unless W&B has a key that its server accepts (TransientError when the server
    cannot be reached)."""
    import wandb  # an optional dependency: imported only when chosen

    try:
        has_key = wandb.login(prompt=False, verify=True)
    except wandb.errors.AuthenticationError as e:
        raise ConfigError(f"metrics.trackers includes 'wandb' but W&B refused its key "
                          f"({' '.join(str(e).split())}); run `wandb login` (or set "
                          "WANDB_API_KEY), or log offline with "
                          "--config.metrics.wandb_mode=offline") from None
    except wandb.errors.CommError as e:
        raise TransientError(f"W&B could not be reached: {' '.join(str(e).split())}") from None
    if not has_key:
        raise ConfigError("metrics.trackers includes 'wandb' in online mode but W&B has no API "
                          "key; run `wandb login` (or set WANDB_API_KEY), or log offline with "
                          "--config.metrics.wandb_mode=offline")


def _mlflow_uri(config: ml_collections.ConfigDict, workdir: str) -> str:
    return (config.metrics.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or "file://" + os.path.abspath(os.path.join(workdir, "mlruns")))


def open_trackers(workdir: str, config: ml_collections.ConfigDict) -> Iterator[Tracker]:
    """The trackers `config.metrics.trackers` chooses, writing into `workdir` (which exists), each
    yielded once open: when one fails to open, the caller closes those before it. Process 0
    only."""
    for name in config.metrics.trackers:
        if name == "jsonl":
            yield Jsonl(workdir)
        elif name == "tensorboard":
            yield TensorBoard(tensorboard_dir(config, workdir))
        else:  # the run is named after the workdir
            run = (_run_id(workdir), os.path.basename(os.path.abspath(workdir)))
            yield (Wandb if name == "wandb" else Mlflow)(workdir, config, *run)


def tensorboard_dir(config: ml_collections.ConfigDict, workdir: str) -> str:
    """Where TensorBoard's event files go: metrics.tensorboard_dir, else <workdir>/tensorboard."""
    return config.metrics.tensorboard_dir or os.path.join(workdir, "tensorboard")


def _run_id(workdir: str) -> str:
    """The workdir's tracker run id: made by its first start, read by every later one."""
    path = os.path.join(workdir, TRACKER_RUN_ID_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    # Lower-case letters and digits, as W&B's own ids; 48 random bits: no two runs of a project
    # share one by chance.
    run_id = secrets.token_hex(6)
    with writing(path, WORKDIR_FIX):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
        os.replace(path + ".tmp", path)  # a crash leaves no half-written id
    return run_id


def _tag(name: str, prefix: str) -> str:
    """`loss` -> `train/loss`, with prefix `eval_` -> `eval/loss`: grouped charts."""
    return f"{prefix.rstrip('_') or 'train'}/{name}"


def _markdown_sample(prompt: str, continuation: str) -> str:
    return f"**{prompt}**{continuation}"


def flat_config(config: ml_collections.ConfigDict) -> dict:
    """`config` as {dotted key: JSON value}, e.g. {"train.steps": 200, "data.sources": [...]}."""
    flat = {}

    def add(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}{key}.", inner)
        else:
            flat[prefix[:-1]] = value

    add("", json.loads(config.to_json_best_effort()))
    return flat


class Jsonl:
    """<workdir>/metrics.jsonl: easy to load with pandas; appended, so a resumed run keeps the
    lines of the run it continues, and flushed per line, so a crash loses none before it."""

    def __init__(self, workdir: str):
        self._workdir = workdir
        self._path = os.path.join(workdir, "metrics.jsonl")
        with writing(self._path, WORKDIR_FIX):
            self._file = open(self._path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Metrics, prefix: str) -> None:
        line = {"step": step, **{prefix + name: value for name, value in metrics.items()}}
        with writing(self._path, WORKDIR_FIX):
            self._file.write(json.dumps(line) + "\n")
            self._file.flush()

    def write_samples(self, step: int, samples: dict[str, str]) -> None:
        # A file of their own: metrics.jsonl stays numbers only, for pandas and latest_metrics.
        path = os.path.join(self._workdir, SAMPLES_FILE)
        with writing(path, WORKDIR_FIX), open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "samples": samples}) + "\n")

    def close(self, failed: bool) -> None:
        with writing(self._path, WORKDIR_FIX):
            self._file.close()


class TensorBoard:
    """Event files in `folder` (metrics.tensorboard_dir: <workdir>/tensorboard/ unless set, a
    local folder or a bucket's); a vector is a histogram over its index."""

    def __init__(self, folder: str):
        self._folder = folder
        register_bucket_writers()
        with writing(self._folder, WORKDIR_FIX):
            self._writer = tensorboardX.SummaryWriter(self._folder)

    def write(self, step: int, metrics: Metrics, prefix: str) -> None:
        for name, value in metrics.items():
            if isinstance(value, list):
                self._add_histogram(_tag(name, prefix), value, step)
            else:
                self._writer.add_scalar(_tag(name, prefix), value, step)
        with writing(self._folder, WORKDIR_FIX):
            self._writer.flush()

    def _add_histogram(self, tag: str, values: list[float], step: int) -> None:
        """`values` as a histogram whose x axis is their index: bucket [i, i + 1) holds
        values[i] (expert i's share of the load), so the chart shows the load expert by
        expert."""
        index = np.arange(len(values), dtype=np.float64)
        weights = np.asarray(values, np.float64)
        self._writer.add_histogram_raw(
            tag, min=0.0, max=float(len(values)), num=float(weights.sum()),
            sum=float(index @ weights), sum_squares=float((index ** 2) @ weights),
            bucket_limits=(index + 1).tolist(), bucket_counts=weights.tolist(),
            global_step=step)

    def write_samples(self, step: int, samples: dict[str, str]) -> None:
        for i, (prompt, text) in enumerate(samples.items()):  # markdown: the prompt in bold
            self._writer.add_text(f"samples/{i}", _markdown_sample(prompt, text), step)
        with writing(self._folder, WORKDIR_FIX):
            self._writer.flush()

    def close(self, failed: bool) -> None:
        with writing(self._folder, WORKDIR_FIX):
            self._writer.close()


class Wandb:
    """A W&B run in `metrics.project`, its files under <workdir>/wandb/. Its mode is
    `metrics.wandb_mode`, else W&B's own (WANDB_MODE, else online); offline runs upload later
    with `wandb sync <workdir>/wandb/offline-run-*`."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict, run_id: str, name: str):
        import wandb  # an optional dependency: imported only when chosen

        self._wandb = wandb
        m = config.metrics
        try:
            # resume="allow": the first start creates the run, a restart continues it.
            self._run = wandb.init(project=m.project, name=name, id=run_id, resume="allow",
                                   dir=workdir, mode=m.wandb_mode or None,
                                   config=flat_config(config))
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
            raise ConfigError(f"metrics.trackers includes 'wandb' but W&B did not start: "
                              f"{' '.join(str(e).split())}; run `wandb login` (or set "
                              "WANDB_API_KEY), or log offline with "
                              "--config.metrics.wandb_mode=offline") from None
        except wandb.errors.CommError as e:
            raise TransientError(f"W&B could not be reached: {' '.join(str(e).split())}") \
                from None

    def write(self, step: int, metrics: Metrics, prefix: str) -> None:
        data = {}
        for name, value in metrics.items():
            if isinstance(value, list):  # bins [i, i + 1) hold value i, as in TensorBoard
                value = self._wandb.Histogram(np_histogram=(value, list(range(len(value) + 1))))
            data[_tag(name, prefix)] = value
        # A restart from a checkpoint logs again the steps after it; W&B keeps the first values
        # of a step it has already seen and warns.
        self._run.log(data, step=step)

    def write_samples(self, step: int, samples: dict[str, str]) -> None:
        table = self._wandb.Table(columns=["prompt", "continuation"],
                                  data=[[prompt, text] for prompt, text in samples.items()])
        self._run.log({"samples": table}, step=step)

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class Mlflow:
    """An MLflow run in the experiment `metrics.project`, tracked at `metrics.mlflow_tracking_uri`,
    else MLFLOW_TRACKING_URI, else file://<workdir>/mlruns. The config is the run's params (a
    restart adds keys it lacks; MLflow never changes a logged param) and, newest, its
    `config.json` artifact."""

    def __init__(self, workdir: str, config: ml_collections.ConfigDict, run_id: str, name: str):
        # An optional dependency: imported only when chosen.
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._Metric = Metric
        uri = _mlflow_uri(config, workdir)
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode behind this switch; it is the one
            # local store mlflow-skinny has (SQLite needs the full mlflow and SQLAlchemy).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(uri)
        project = config.metrics.project
        experiment = client.get_experiment_by_name(project)
        experiment_id = (experiment.experiment_id if experiment
                         else client.create_experiment(project))
        found = client.search_runs([experiment_id], max_results=1,
                                   filter_string=f"tags.{_MLFLOW_RUN_ID_TAG} = '{run_id}'")
        if found:
            run = found[0]
            client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=name,
                                    tags={_MLFLOW_RUN_ID_TAG: run_id})
        self._run_id = run.info.run_id
        values = {key: value if isinstance(value, str) else json.dumps(value)
                  for key, value in flat_config(config).items()}
        params = [Param(key, value[:_MLFLOW_PARAM_LIMIT]) for key, value in values.items()
                  if key not in run.data.params]
        for start in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            client.log_batch(self._run_id,
                             params=params[start:start + _MLFLOW_PARAMS_PER_BATCH])
        client.log_dict(self._run_id, json.loads(config.to_json_best_effort()), "config.json")

    def write(self, step: int, metrics: Metrics, prefix: str) -> None:
        now_ms = int(time.time() * 1000)
        batch = []
        for name, value in metrics.items():
            tag = _tag(name, prefix)
            if isinstance(value, list):
                batch += [self._Metric(f"{tag}/{i}", x, now_ms, step) for i, x in enumerate(value)]
            else:
                batch.append(self._Metric(tag, value, now_ms, step))
        self._client.log_batch(self._run_id, metrics=batch)

    def write_samples(self, step: int, samples: dict[str, str]) -> None:
        """An artifact per sampling step, samples/step_<step>.md (MLflow has no text metric)."""
        text = "\n\n".join(_markdown_sample(prompt, t) for prompt, t in samples.items())
        self._client.log_text(self._run_id, text, f"samples/step_{step:08d}.md")

    def close(self, failed: bool) -> None:
        self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")
