"""Checkpoint speed: how long an async save blocks the training loop, against a synchronous save.

    python benchmarks/checkpoint.py [--workdir=DIR] [--repeats=3]

In one run, for two Llama train states (float32 params and AdamW moments): a small one (25M
parameters, 300 MB) and one at the scale an accelerator user saves (Llama 3.2 1B's shapes with 3 of
its 16 layers: 445M parameters, 5.3 GB, about llama_1b's float32 parameters alone):
  * saves each `--repeats` times synchronously and asynchronously, taking turns (after one warm-up
    save each), and times the blocking part (what the training loop waits for) and the total
    (until durable); the figures are medians;
  * restores the newest checkpoint;
  * for the small state, starts `python -m jaxscale.train` in a workdir holding that checkpoint,
    with JAX's persistent compilation cache off, cold and warm, and times process start -> first
    step logged.
The last line is `ratio: X`, async blocking / sync save time of the large state; the target is
<= 0.10. On CPU devices the "copy off the devices" that blocks is a host memcpy; on a GPU or TPU it
is a device-to-host transfer, so the small state's ratio says little there and the large one's
bounds it from below.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

from jaxscale.checkpoint import Checkpoints  # noqa: E402
from jaxscale.config import default_config  # noqa: E402
from jaxscale.data import make_input  # noqa: E402
from jaxscale.trainer import Trainer  # noqa: E402

# About 25M parameters: 300 MB of float32 params + AdamW moments.
MODEL = dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, mlp_dim=1536)
# Llama 3.2 1B's shapes (configs/llama_1b.py) with 3 of its 16 layers: 445M parameters, 5.3 GB of
# float32 params + AdamW moments (the whole model's would be 15 GB, more than this machine holds
# twice).
LARGE_MODEL = dict(vocab_size=128256, d_model=2048, n_layers=3, n_heads=32, n_kv_heads=8,
                   head_dim=64, mlp_dim=8192, tie_embeddings=True)
TRAIN = dict(batch_size=4, seq_len=64, steps=1000, log_every=1, eval_every=0)


def make_config(model: dict):
    config = default_config()
    config.model.update(model)
    config.train.update(TRAIN)
    config.checkpoint.every_steps = 0  # nothing but the first step's compile and run matters
    return config


def state_megabytes(state) -> float:
    return sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20


def time_saves(config, workdir, state, data_state,
               repeats: int) -> dict[str, dict[str, list[float]]]:
    """{"sync"|"async": {"blocking"|"total": seconds of each save}}. Sync and async saves take
    turns, so both see the same load on a shared machine; each mode's first save (which sets
    Orbax up) is not counted."""
    timings = {mode: {"blocking": [], "total": []} for mode in ("sync", "async")}
    with Checkpoints(config, os.path.join(workdir, "sync"), async_save=False) as sync, \
            Checkpoints(config, workdir, async_save=True) as async_:
        for step in range(repeats + 1):
            for mode, checkpoints in (("sync", sync), ("async", async_)):
                checkpoints.save(step, state, data_state, {"step": step, "productive_seconds": 0})
                checkpoints.wait()
                measured = checkpoints.take_metrics()
                if step:
                    timings[mode]["blocking"].append(measured["checkpoint_blocking_seconds"])
                    timings[mode]["total"].append(measured["checkpoint_seconds"])
    return timings


def seconds_to_first_step(workdir: str, cache: str) -> tuple[float, float]:
    """(process start -> first step logged, the trainer's own time_to_first_step) of a restart in
    `workdir`; `cache` is "off" or a compilation cache folder."""
    flags = [f"--config.model.{k}={v}" for k, v in MODEL.items()]
    flags += [f"--config.train.{k}={v}" for k, v in TRAIN.items()]
    flags += ["--config.checkpoint.every_steps=0", f"--workdir={workdir}"]
    if cache == "off":
        flags.append("--config.checkpoint.compilation_cache=False")
    else:
        flags.append(f"--config.checkpoint.compilation_cache_dir={cache}")
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    begin = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "jaxscale.train", *flags], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not (os.path.exists(metrics) and os.path.getsize(metrics)):
        if process.poll() is not None:
            raise RuntimeError(f"the restarted run failed: {process.stderr.read()[-2000:]}")
        time.sleep(0.05)
    seconds = time.perf_counter() - begin
    process.kill()  # one step is all this measures
    process.communicate()
    with open(metrics, encoding="utf-8") as f:
        first_line = json.loads(f.readline())
    return seconds, first_line["time_to_first_step"]


def save_and_restore(model: dict, workdir: str, repeats: int) -> float:
    """Prints the save and restore times of `model`'s train state; returns async blocking / sync
    save time."""
    config = make_config(model)
    config.checkpoint.compilation_cache = False  # this process's compiles are not measured
    trainer = Trainer(config, workdir)
    state = jax.block_until_ready(trainer.program.init_state(0))
    data_state = make_input(config, "train", trainer.program.batch_sharding).get_state()
    print(f"state: {state_megabytes(state):.0f} MB on {jax.device_count()} "
          f"{jax.devices()[0].device_kind} device(s); checkpoints in {workdir}")

    timings = time_saves(config, workdir, state, data_state, repeats)
    median = {mode: {k: statistics.median(v) for k, v in t.items()} for mode, t in timings.items()}
    sync_save, async_block = median["sync"]["total"], median["async"]["blocking"]
    print(f"  sync save: {sync_save:.3f} s (median of {repeats})")
    print(f"  async save: blocking {async_block:.3f} s, total {median['async']['total']:.3f} s")

    with Checkpoints(config, workdir) as checkpoints:
        restored = checkpoints.restore_newest(trainer.program.abstract_state)
    print(f"  restore: {restored.seconds:.3f} s ({restored.path})")
    return async_block / sync_save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="jaxscale_checkpoint_bench_")
    os.makedirs(workdir, exist_ok=True)

    small_ratio = save_and_restore(MODEL, workdir, args.repeats)
    print(f"  async blocking / sync save: {small_ratio:.3f}")

    cache = os.path.join(workdir, "compilation_cache")
    shutil.rmtree(cache, ignore_errors=True)
    for label, cache_setting in (("compilation cache off", "off"), ("cold cache", cache),
                                 ("warm cache", cache)):
        wall, trainer_seconds = seconds_to_first_step(workdir, cache_setting)
        print(f"restart to first step, {label}: {wall:.1f} s "
              f"(time_to_first_step {trainer_seconds:.1f} s)")

    large = os.path.join(workdir, "large")
    ratio = save_and_restore(LARGE_MODEL, large, args.repeats)
    shutil.rmtree(large)  # 5 GB per checkpoint kept
    print(f"ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
