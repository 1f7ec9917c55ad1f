"""Experiment trackers (jaxscale/observe/trackers.py): the same metrics, steps and config in
metrics.jsonl, TensorBoard, W&B (offline) and MLflow (a local file store), each read back with its
own client; one run per workdir across restarts; a missing package or unknown tracker is a one-line
error before anything is written."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxscale.checks import validate
from jaxscale.config import default_config
from jaxscale.errors import ConfigError
from jaxscale.observe import trackers
from jaxscale.observe.metrics import MetricsWriter
from tests.test_metrics import event_files, read_jsonl, read_tensorboard_scalars, tensorboard_values

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B's caches and settings in `tmp_path` and no W&B or MLflow settings from the
    environment; restored afterwards, without the MLFLOW_ALLOW_FILE_STORE the trackers set, and
    without the settings and login W&B keeps for the whole process (read from the environment
    once, they would carry one test's server and key into the next)."""
    # Set first, so that monkeypatch records it and removes it again after the test.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    for name in list(os.environ):
        if name.startswith(("WANDB_", "MLFLOW_")):
            monkeypatch.delenv(name)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    if sys.modules.get("wandb"):  # imported, and not hidden by a test of a missing package
        sys.modules["wandb"].teardown()


def tracker_config(*names, **metrics):
    config = default_config()
    config.metrics.update(trackers=names, **{"wandb_mode": "offline", **metrics})
    return config


def mlflow_run(workdir, project="jaxscale"):
    """The one MLflow run of `project` in the workdir's default file store, read by MLflow."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient("file://" + os.path.join(workdir, "mlruns"))
    (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
    return client, run


def mlflow_history(client, run, key):
    return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]


def wandb_runs(workdir):
    """Each offline W&B run folder's records, read by W&B's own CLI (`wandb leet inspect`): W&B
    has no Python API for offline runs, and the .wandb file's format is its own."""
    folder = os.path.join(workdir, "wandb")
    runs = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("offline-run-"):
            result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                                     os.path.join(folder, name)],
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, result.stderr
            runs.append([json.loads(line) for line in result.stdout.splitlines()])
    return runs


def wandb_history(records):
    """{step: {key: value}} of one offline run's logged rows, W&B's own keys (`_step`) left out."""
    return {r["history"]["step"]["num"]: {k: v for k, v in r["history"]["item"].items()
                                          if not k.startswith("_")}
            for r in records if r["type"] == "history"}


def the_run(records, kind):
    (record,) = [r[kind] for r in records if r["type"] == kind]
    return record


def write_steps(workdir, config, steps):
    with MetricsWriter(str(workdir), enabled=True, total_steps=4, config=config,
                       stream=io.StringIO()) as writer:
        for step in steps:
            writer.write(step, {"loss": 1.0 / step, "tokens": 4096 * step,
                                "moe_expert_load": np.array([0.75, 0.25])})
            writer.write(step, {"loss": 2.0 / step}, prefix="eval_")


def test_every_tracker_gets_the_same_metrics_steps_and_config(tmp_path, offline):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    config = tracker_config("jsonl", "tensorboard", "wandb", "mlflow")
    write_steps(tmp_path, config, (1, 2))

    assert read_jsonl(tmp_path) == [
        {"step": 1, "loss": 1.0, "tokens": 4096, "moe_expert_load": [0.75, 0.25]},
        {"step": 1, "eval_loss": 2.0},
        {"step": 2, "loss": 0.5, "tokens": 8192, "moe_expert_load": [0.75, 0.25]},
        {"step": 2, "eval_loss": 1.0},
    ]
    (events,) = event_files(str(tmp_path))
    scalars = read_tensorboard_scalars(events)
    assert {k: v for k, v in scalars.items() if k[0] != "train/moe_expert_load"} == {
        ("train/loss", 1): 1.0, ("train/tokens", 1): 4096, ("eval/loss", 1): 2.0,
        ("train/loss", 2): 0.5, ("train/tokens", 2): 8192, ("eval/loss", 2): 1.0}

    (records,) = wandb_runs(tmp_path)
    assert wandb_history(records) == {
        step: {"train/loss": 1.0 / step, "train/tokens": 4096 * step, "eval/loss": 2.0 / step,
               "train/moe_expert_load._type": "histogram",
               "train/moe_expert_load.bins": [0, 1, 2],  # bin i, [i, i + 1): expert i
               "train/moe_expert_load.values": [0.75, 0.25]}
        for step in (1, 2)}
    run = the_run(records, "run")
    assert run["project"] == "jaxscale" and run["display_name"] == tmp_path.name
    assert run["run_id"] == (tmp_path / trackers.TRACKER_RUN_ID_FILE).read_text().strip()
    wandb_config = run["config"]["update"]
    assert wandb_config["train.steps"] == 200 and wandb_config["optim.lr"] == 3e-3
    assert wandb_config["metrics.trackers"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert the_run(records, "exit")["exit_code"] == 0

    client, run = mlflow_run(tmp_path)
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
    assert mlflow_history(client, run, "train/loss") == [(1, 1.0), (2, 0.5)]
    assert mlflow_history(client, run, "train/tokens") == [(1, 4096), (2, 8192)]
    assert mlflow_history(client, run, "eval/loss") == [(1, 2.0), (2, 1.0)]
    assert mlflow_history(client, run, "train/moe_expert_load/1") == [(1, 0.25), (2, 0.25)]
    params = run.data.params
    assert params["train.steps"] == "200" and params["optim.lr"] == "0.003"
    assert json.loads(params["metrics.trackers"]) == wandb_config["metrics.trackers"]
    assert set(params) == set(wandb_config) - {"_wandb"}


def test_a_restart_continues_the_same_wandb_and_mlflow_run(tmp_path, offline):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    config = tracker_config("wandb", "mlflow")
    write_steps(tmp_path, config, (1, 2))
    config.train.steps = 4  # a restart that trains further
    write_steps(tmp_path, config, (3, 4))

    client, run = mlflow_run(tmp_path)  # one run, all four steps
    assert [step for step, _ in mlflow_history(client, run, "train/loss")] == [1, 2, 3, 4]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "200"  # MLflow never changes a logged param...
    config_json = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    with open(config_json, encoding="utf-8") as f:
        assert json.load(f)["train"]["steps"] == 4  # ...so the newest config is an artifact

    first, second = wandb_runs(tmp_path)  # offline: one folder per start, one run id
    assert the_run(first, "run")["run_id"] == the_run(second, "run")["run_id"]
    assert sorted(wandb_history(first)) == [1, 2] and sorted(wandb_history(second)) == [3, 4]
    assert the_run(second, "run")["config"]["update"]["train.steps"] == 4


def test_a_run_that_raised_is_marked_failed(tmp_path, offline):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    with pytest.raises(RuntimeError, match="boom"):
        with MetricsWriter(str(tmp_path), enabled=True, total_steps=4, stream=io.StringIO(),
                           config=tracker_config("wandb", "mlflow")) as writer:
            writer.write(1, {"loss": 1.0})
            raise RuntimeError("boom")
    assert mlflow_run(tmp_path)[1].info.status == "FAILED"
    (records,) = wandb_runs(tmp_path)
    assert the_run(records, "exit")["exit_code"] == 1


def test_mlflow_params_longer_than_its_limit_are_cut_and_the_uri_and_project_are_kept(
        tmp_path, offline):
    pytest.importorskip("mlflow")
    config = tracker_config("mlflow", project="llama-sweep",
                            mlflow_tracking_uri="file://" + str(tmp_path / "store"))
    config.data.sources = (dict(format="text", path="x" * 7000),)
    write_steps(tmp_path / "run", config, (1,))
    assert not (tmp_path / "run" / "mlruns").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient("file://" + str(tmp_path / "store"))
    (run,) = client.search_runs([client.get_experiment_by_name("llama-sweep").experiment_id])
    sources = run.data.params["data.sources"]
    assert len(sources) == 6000 and sources.startswith('[{"format": "text", "path": "xxx')


def test_online_wandb_without_a_login_is_a_config_error_saying_how_to_log_in(
        tmp_path, offline, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc holding a key
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ConfigError, match=r"^metrics.trackers includes 'wandb' but W&B did not "
                                          r"start: .*; run `wandb login`.*wandb_mode=offline$"):
        write_steps(tmp_path / "run", tracker_config("jsonl", "wandb", wandb_mode="online"), ())
    assert not list((tmp_path / "run" / "wandb").glob("*run-*"))  # no W&B run was started


def test_the_default_trackers_make_no_run_id_and_no_tracker_folders(tmp_path):
    write_steps(tmp_path, default_config(), (1,))
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "tensorboard"]


@pytest.mark.parametrize("name, extra", [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_a_missing_package_is_a_config_error_naming_the_extra(monkeypatch, name, extra):
    monkeypatch.setitem(sys.modules, name, None)  # as if not installed: `import` fails
    with pytest.raises(ConfigError) as error:
        trackers.check_trackers(tracker_config("jsonl", name))
    assert str(error.value) == (f"metrics.trackers includes {name!r} but the {name} package is "
                                f"not installed; pip install 'jaxscale[{extra}]'")


@pytest.mark.parametrize("names, words", [
    (("jsonl", "comet"), "includes 'comet', which is unknown; use any of ('jsonl', "
                         "'tensorboard', 'wandb', 'mlflow')"),
    (("jsonl,mlflow",), "as a tuple: --config.metrics.trackers=\"('jsonl','mlflow')\""),
    (("jsonl", "jsonl"), "names a tracker twice"),
])
def test_bad_tracker_names_are_config_errors(names, words):
    with pytest.raises(ConfigError, match="metrics.trackers") as error:
        validate(tracker_config(*names), num_devices=8)  # the start-up checks include them
    assert words in str(error.value)


def test_an_unknown_wandb_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"metrics.wandb_mode='cloud' is unknown; use one of "
                                          r"\('', 'online', 'offline'\)"):
        trackers.check_trackers(tracker_config("jsonl", wandb_mode="cloud"))


@pytest.mark.parametrize("name, variable, value, words", [
    ("wandb", "WANDB_MODE", "cloud", "Input should be 'online', 'offline'"),
    ("wandb", "WANDB_HTTP_TIMEOUT", "soon", "a valid number"),
    ("mlflow", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "many", "Failed to convert 'many'"),
])
def test_a_tracker_variable_its_library_refuses_is_a_config_error_at_start_up(
        offline, monkeypatch, name, variable, value, words):
    """The tracker libraries read their own environment variables; one they refuse (W&B's raised
    a 46-line traceback from wandb.init, after the workdir was written) is refused by the start-up
    checks, whatever metrics.wandb_mode says."""
    pytest.importorskip(name)
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as error:
        validate(tracker_config("jsonl", name), num_devices=8)
    message = str(error.value)
    assert message.startswith(f"the environment variable {variable}={value!r}, which {name} "
                              "reads, is refused by it (") and "\n" not in message
    assert words in message and message.endswith(f"; fix or unset {variable}")


def test_a_missing_package_stops_the_cli_before_anything_is_written(tmp_path):
    """The real start-up order: the error comes from the checks, so the workdir stays empty."""
    workdir = tmp_path / "run"
    code = ("import sys; sys.modules['mlflow'] = None; from jaxscale.train import main; "
            "main(sys.argv)")
    result = subprocess.run(
        [sys.executable, "-c", code, "--config=configs/tiny.py", f"--workdir={workdir}",
         "--config.metrics.trackers=('jsonl','mlflow')"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: metrics.trackers includes 'mlflow' but the mlflow package is not installed; "
        "pip install 'jaxscale[mlflow]'"]
    assert not workdir.exists() or not os.listdir(workdir)


@pytest.mark.slow
def test_a_cli_run_logs_the_same_losses_to_mlflow_and_wandb(tmp_path, offline, monkeypatch):
    """`python -m jaxscale.train` with every tracker: MLflow's and W&B's losses are the JSON
    lines', step for step, and their config is the run's."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "jaxscale.train", "--config=configs/tiny.py",
         f"--workdir={workdir}", "--config.train.steps=4", "--config.train.log_every=2",
         "--config.train.eval_every=4", "--config.train.eval_batches=1",
         "--config.train.seq_len=64", "--config.checkpoint.compilation_cache=False",
         "--config.metrics.trackers=('jsonl','tensorboard','wandb','mlflow')",
         "--config.metrics.wandb_mode=offline"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = read_jsonl(workdir)
    losses = [(line["step"], line["loss"]) for line in lines if "loss" in line]
    eval_losses = [(line["step"], line["eval_loss"]) for line in lines if "eval_loss" in line]
    assert [step for step, _ in losses] == [2, 4] and [s for s, _ in eval_losses] == [4]

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the reading client
    client, run = mlflow_run(workdir)
    assert mlflow_history(client, run, "train/loss") == losses
    assert mlflow_history(client, run, "eval/loss") == eval_losses
    assert run.data.params["train.steps"] == "4"

    (records,) = wandb_runs(workdir)
    history = wandb_history(records)
    assert [(step, row["train/loss"]) for step, row in sorted(history.items())
            if "train/loss" in row] == losses
    assert the_run(records, "run")["config"]["update"]["train.steps"] == 4


def test_a_fresh_start_over_an_earlier_one_gets_a_new_tracker_run(tmp_path):
    """An earlier start that left metrics but no checkpoint is set aside with its run id: a start
    from step 0 opens a new W&B/MLflow run instead of logging its steps again into the old."""
    from jaxscale.runtime.workdir import set_aside_earlier_start

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    first = trackers._run_id(str(tmp_path))
    assert trackers._run_id(str(tmp_path)) == first  # a restart reads the same id
    earlier = set_aside_earlier_start(str(tmp_path))
    assert (tmp_path / earlier / trackers.TRACKER_RUN_ID_FILE).read_text().strip() == first
    assert trackers._run_id(str(tmp_path)) != first


def read_tensorboard_texts(path):
    """{(tag, step): text} of the text summaries in a TFRecord event file."""
    # tensorboardX names a text summary <tag>/text_summary.
    return {(value.tag.removesuffix("/text_summary"), step): value.tensor.string_val[0].decode()
            for step, value in tensorboard_values(path)
            if value.metadata.plugin_data.plugin_name == "text"}


def test_every_tracker_gets_the_samples(tmp_path, offline):
    """train.sample_every's continuations: a line per step in samples.jsonl (metrics.jsonl keeps
    numbers only), a text per prompt in TensorBoard, a table in W&B, an artifact in MLflow."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    config = tracker_config("jsonl", "tensorboard", "wandb", "mlflow")
    samples = {2: {"Once upon": " a time", "def f(": "x):"}, 4: {"Once upon": " a hill",
                                                                 "def f(": "):"}}
    with MetricsWriter(str(tmp_path), enabled=True, total_steps=4, config=config,
                       stream=io.StringIO()) as writer:
        for step, texts in samples.items():
            writer.write(step, {"loss": 1.0})
            writer.write_samples(step, texts)

    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"step": step, "samples": texts} for step, texts in samples.items()]
    assert all("samples" not in line for line in read_jsonl(tmp_path))

    (events,) = event_files(str(tmp_path))
    assert read_tensorboard_texts(events) == {
        ("samples/0", 2): "**Once upon** a time", ("samples/1", 2): "**def f(**x):",
        ("samples/0", 4): "**Once upon** a hill", ("samples/1", 4): "**def f(**):"}

    (records,) = wandb_runs(tmp_path)
    folder = [p for p in (tmp_path / "wandb").iterdir() if p.name.startswith("offline-run-")][0]
    for step, row in wandb_history(records).items():
        # The table's rows are in the file the history row names (W&B's own JSON table format).
        table = json.loads((folder / "files" / row["samples.path"]).read_text())
        assert table["columns"] == ["prompt", "continuation"]
        assert table["data"] == [list(item) for item in samples[step].items()]

    client, run = mlflow_run(tmp_path)
    for step, texts in samples.items():
        path = client.download_artifacts(run.info.run_id, f"samples/step_{step:08d}.md",
                                         str(tmp_path / "download"))
        assert open(path).read() == "\n\n".join(f"**{p}**{t}" for p, t in texts.items())
