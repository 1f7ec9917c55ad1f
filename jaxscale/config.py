"""Config defaults and validation.

A config file is a Python file whose `get_config()` returns an `ml_collections.ConfigDict` built on
`default_config()` (loaded by `jaxscale.cli`). The schema is `default_config()` (every key, its
default) and `NUMBERS` (the kind of every numeric key: whole or real, its range, what 0 or -1
means); `check_schema` checks a config against both without importing anything, and
`check_settings` adds the rules between its own keys (jaxscale/checks.py composes them with each
component's checks and the devices'). Each raises `ConfigError` with the key, the bad value and
the fix, before anything is compiled or written. This module imports nothing of jaxscale but the
errors and the kinds of number: everything else imports it.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from jaxscale.errors import ConfigError
from jaxscale.kinds import real, whole

# Multi-process runs: how long `jax.distributed.initialize` waits for every process to join, and
# the seconds without a heartbeat after which JAX declares a process dead and stops the others
# (the bound on how long survivors of a crashed peer keep running).
DEFAULT_INIT_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
# The mesh axes' size keys (their order of layout is jaxscale/parallel/mesh.py's MESH_AXES).
_MESH_AXIS_KEYS = ("data", "fsdp", "tensor", "pipeline", "expert", "context")
LOGICAL_AXES = (
    "batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
    "experts",
)
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
MATMUL_PRECISIONS = ("bfloat16", "fp8")  # precision.matmul
# sharding.optimizer_state: with each parameter, or also split over the data-parallel axes (ZeRO-1).
OPTIMIZER_STATE_LAYOUTS = ("params", "data")


def default_config() -> ml_collections.ConfigDict:
    """Every key jaxscale understands, with its default. Config files start from this."""
    c = ml_collections.ConfigDict()

    c.train = dict(
        steps=200,
        seed=0,
        batch_size=16,  # global, in sequences
        seq_len=128,
        microbatches=1,  # gradient accumulation: the batch is split into this many parts
        log_every=10,
        eval_every=100,  # 0 disables periodic eval
        eval_batches=4,
        # Stop the run after this many non-finite (skipped) steps in a row.
        max_bad_steps=20,
        # Multi-host: warn when the slowest host makes each step this much longer (metrics:
        # step_time_max_host_s, slowest_host, host_time_*).
        straggler_ratio=1.2,
        # Every sample_every steps (0: never), the greedy continuation of each prompt, sample_tokens
        # new tokens, logged as text to every tracker (<workdir>/samples.jsonl, TensorBoard, ...).
        sample_every=0,
        sample_prompts=(),
        sample_tokens=32,
    )
    # Mesh axis sizes within a slice (ICI); -1 takes the devices left over. `dcn` multiplies an axis
    # across slices / hosts connected by the data-centre network.
    c.mesh = dict(**{axis: -1 if axis == "data" else 1 for axis in _MESH_AXIS_KEYS},
                  dcn={axis: 1 for axis in _MESH_AXIS_KEYS},
                  # True: the planner chooses the sizes above, the remat policy, accumulation and
                  # optimizer-state layout at start-up (docs/planning.md), planning for
                  # auto_memory_gib GiB per device (0: the capacity the memory check uses,
                  # performance.device_memory_gib or what the device reports; CPUs have none),
                  # and times auto_trials candidates that fit for a few steps on the devices, a
                  # spread of the meshes its estimate cannot tell apart (1: trusts its ranking).
                  auto=False, auto_memory_gib=0.0, auto_trials=3)
    # Logical axis name -> tuple of mesh axes it is sharded over (empty: replicated).
    c.sharding = dict(
        rules=dict(
            # Rows split over the expert axis too: the dense layers stay data-parallel there.
            batch=("data", "fsdp", "expert"),
            length=("context",),  # long sequences: activations split along the sequence
            embed=("fsdp",),
            heads=("tensor",),
            kv_heads=("tensor",),
            head_dim=(),
            mlp=("tensor",),
            vocab=("tensor",),
            layers=("pipeline",),  # pipeline stages hold consecutive layers
            experts=("expert",),  # the experts of an MoE layer (model.moe)
        ),
        # Where the optimizer state lives: "params" (with each parameter) or "data" (ZeRO-1: also
        # split over the data-parallel axes; see docs/parallelism.md).
        optimizer_state="params",
    )
    # Pipeline parallelism over mesh.pipeline stages (docs/parallelism.md): the per-step batch (of
    # each train.microbatches part) goes through in `microbatches` parts (0: 2 x stages); each
    # stage holds `repeats` groups of layers (circular); schedule gpipe | 1f1b (repeats 1).
    c.pipeline = dict(microbatches=0, repeats=1, schedule="gpipe")
    c.model = dict(
        name="llama",  # the model family: llama | qwen3 (jaxscale/models/__init__.py)
        vocab_size=259,  # the byte tokenizer: 256 bytes + pad, bos, eos
        vocab_multiple=128,  # the embedding is padded to a multiple of this (shards evenly)
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        mlp_dim=768,
        max_seq_len=2048,
        rope_theta=10000.0,
        # Llama 3.1+ RoPE frequency scaling (Hugging Face rope_type "llama3"): type none | llama3;
        # the other keys are read for llama3 only (their defaults are Llama 3.1's).
        rope_scaling=dict(type="none", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_seq_len=8192),
        norm_eps=1e-5,
        tie_embeddings=False,
        remat="none",  # jaxscale.models.REMAT_POLICIES: none | full | save_dots
        # The attention kernel: auto (splash on TPU, cudnn on GPU, else xla) | xla | splash (TPU)
        # | cudnn (NVIDIA GPU); see jaxscale/parallel/attention.py.
        attention="auto",
        # How the step runs (jaxscale/training/step_settings.py): layers per iteration of the
        # layer loop (lax.scan's unroll; 0: no loop), the sequence positions and vocabulary
        # entries whose float32 logits the loss holds at once (0: all). The same loss either
        # way; -1: chosen for the device (GPUs: unrolled, whole logits where that fits; TPUs and
        # CPUs: a loop, 1024 positions x 16384 entries).
        scan_unroll=-1,
        loss_chunk_len=-1,
        loss_vocab_tile=-1,
        # Mixture of experts (jaxscale/models/moe.py): every `every`-th layer's feed-forward is
        # `experts` SwiGLU experts of mlp_dim, each token routed to its top_k (0: all dense).
        # Each expert takes capacity_factor x an even share of a sequence's tokens; the rest
        # are dropped (0: dropless, grouped matmuls over every assignment). The training loss
        # adds aux_loss_weight x the load-balancing loss and z_loss_weight x the router z-loss.
        moe=dict(experts=0, top_k=2, capacity_factor=1.25, every=0, aux_loss_weight=0.01,
                 z_loss_weight=0.001),
        # LoRA (jaxscale/models/lora.py): rank > 0 trains low-rank adapters beside the target
        # weights (q k v o of attention, gate up down of the feed-forward) with everything else
        # frozen in the compute dtype; each adapter adds (alpha / rank) x A B to its weight.
        # dropout: in the train step only, each element of an adapter's input is zeroed with
        # this probability (PEFT's lora_dropout). The base is checkpoint.restore_from (a
        # Hugging Face folder or a run), else the init.
        lora=dict(rank=0, alpha=16.0, dropout=0.0,
                  targets=("q", "k", "v", "o", "gate", "up", "down")),
    )
    c.optim = dict(
        lr=3e-3,
        warmup_steps=20,
        min_lr_ratio=0.1,  # cosine reaches lr * min_lr_ratio at the last step
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,  # not applied to norms and biases
        grad_clip=1.0,  # global-norm clipping; 0 disables
        # Storage dtype of Adam's moments (mu and nu; the update is computed in float32):
        # float32 | bfloat16 (half their memory; see docs/performance.md for nu's precision).
        moment_dtype="float32",
        # Keep the moments in host memory (pinned_host) and move them to the device for the update.
        offload_state=False,
    )
    c.precision = dict(
        compute_dtype="bfloat16",  # matmuls and activations; params/optimizer stay float32
        # The dtype the attention, dense feed-forward and head weights' gradients are made and
        # summed over the data-parallel devices in: bfloat16 (2 bytes a parameter on the wire,
        # each partial sum rounded to bfloat16) | float32 (4 bytes, twice the traffic). Moot with
        # float32 compute; float32 either way with float16 compute. bfloat16 moved tiny's loss
        # less than reordering float32 sums does: docs/performance.md.
        grad_reduce_dtype="bfloat16",
        # The attention and dense feed-forward weight matmuls: bfloat16 (the compute dtype) |
        # fp8 (e4m3 forward, e5m2 gradients, per-tensor delayed scaling; needs bfloat16 compute
        # and, on a GPU, compute capability 8.9+). The head, attention and loss stay as they are.
        matmul="bfloat16",
        # fp8: the steps of amax history each scale is set from (docs/performance.md, FP8).
        fp8_amax_history=16,
        # Dynamic loss scaling, used only with float16 compute.
        loss_scale_init=2.0 ** 15,
        loss_scale_growth_interval=2000,
    )
    # See docs/data.md for the source formats and their keys.
    c.data = dict(
        # A tuple of dicts, mixed by `weight`: stdlib (this Python's own .py files), synthetic
        # (random tokens), text, jsonl, parquet, array_record, tokens (from jaxscale.data.prepare),
        # chat (conversations or prompt/completion pairs: the loss on the replies only).
        sources=(dict(format="stdlib"),),
        tokenizer="byte",  # byte | a SentencePiece .model | a Hugging Face tokenizer.json
        add_bos=True,  # frame each document as BOS + text + EOS
        add_eos=True,
        bos_token="",  # a learned tokenizer's BOS/EOS token; "" = its own (SentencePiece)
        eos_token="",
        # concat (concat-then-split, no padding) | first_fit (whole documents) | auto: first_fit
        # when a source is chat data (a conversation must not be cut), else concat
        packing="auto",
        # The most runs (documents, padding counted as one) a packed row holds; a row with more is
        # cut into several, padded. 0: no bound. A bound puts packed rows in cuDNN's packed layout
        # on GPUs: faster attention, a workspace that grows with it (parallel/attention.py).
        max_segments=0,
        max_bad_records=100,  # malformed records a process skips before the run fails
        # Threads reading and tokenizing the row streams; 0 reads on the prefetch thread; -1: 0
        # for the byte tokenizer, 4 for learned ones. Batches are the same for any value.
        workers=-1,
        prefetch=2,  # batches prepared ahead of the step
    )
    # A jax.profiler trace of steps start_step .. start_step + steps - 1 in <workdir>/profile/
    # (docs/performance.md); steps=0: off. Process 0 only unless all_processes.
    c.profile = dict(start_step=10, steps=0, all_processes=False)
    # Where process 0 sends the metrics besides the console (docs: README, Reading the metrics):
    # any of jsonl (<workdir>/metrics.jsonl), tensorboard, wandb, mlflow (pip install
    # 'jaxscale[wandb]' / 'jaxscale[mlflow]'). `project` is the W&B project and the MLflow
    # experiment; wandb_mode: online | offline | "" (W&B's own: WANDB_MODE, else online);
    # mlflow_tracking_uri: "" -> MLFLOW_TRACKING_URI, else file://<workdir>/mlruns.
    c.metrics = dict(trackers=("jsonl", "tensorboard"), project="jaxscale", wandb_mode="",
                     mlflow_tracking_uri="")
    # XLA flags: "auto" (a tuned set on NVIDIA GPUs; jaxscale/runtime/xla_flags.py), "none", or a
    # string of "--xla_...=..." flags. Flags already in the XLA_FLAGS environment variable win.
    # device_memory_gib: what one device holds, which the train step's compiled memory must fit
    # before the run starts (0: the capacity the backend reports; CPUs report none, so unchecked).
    c.performance = dict(xla_flags="auto", device_memory_gib=0.0)
    # Multi-process runs (docs/launch.md): how long to wait for every process to join, and how long
    # a silent process may go before the others are stopped.
    c.distributed = dict(init_timeout_s=DEFAULT_INIT_TIMEOUT_S,
                         heartbeat_timeout_s=DEFAULT_HEARTBEAT_TIMEOUT_S)
    # See docs/checkpointing.md.
    c.checkpoint = dict(
        enabled=True,
        dir="",  # "" -> <workdir>/checkpoints; any path Orbax writes (local, gs://...)
        every_steps=100,  # save when the step is a multiple; 0: not by steps
        every_minutes=0.0,  # save when this long has passed since the last save; 0: not by time
        keep=3,  # the newest checkpoints kept
        keep_every_steps=0,  # also keep for good each checkpoint whose step is a multiple; 0: none
        # The local tier (docs/checkpointing.md, Two tiers): a folder on each host (a RAM disk, a
        # local SSD; "": none), saved to every local_every_steps steps (0: not by steps) or
        # local_every_minutes (0: not by time) and on SIGTERM, keeping the newest local_keep.
        local_dir="",
        local_every_steps=0,
        local_every_minutes=0.0,
        local_keep=2,
        # Start from another run's checkpoint (its workdir, checkpoint folder or one step folder)
        # when this run has none of its own yet.
        restore_from="",
        restore_params_only=False,  # with restore_from: params only (fine-tuning), from step 0
        compilation_cache=True,  # JAX's persistent compilation cache: restarts skip compiling
        compilation_cache_dir="",  # "" -> <workdir>/compilation_cache
    )
    return c


_MESH_SIZE = whole("[1, inf)", {-1: "the devices left over"})
_SIZE = whole("[1, inf)")
_OFF = {0: "off"}
# The kind of every number in default_config(), section by section: `check_schema` checks them
# before anything else (the command line as soon as it has read the flags). A number added to
# default_config() needs its line here: tests/test_faults_inputs.py fails until it has one.
NUMBERS = {
    "train.steps": _SIZE,
    "train.seed": whole(f"[0, {2 ** 63 - 1}]"),  # JAX's and NumPy's seeds: a non-negative int64
    "train.batch_size": _SIZE,
    "train.seq_len": _SIZE,
    "train.microbatches": _SIZE,
    "train.log_every": _SIZE,
    "train.eval_every": whole("[0, inf)", {0: "no periodic eval"}),
    "train.eval_batches": _SIZE,  # an eval of no batches would log a loss of 0
    "train.max_bad_steps": _SIZE,
    "train.straggler_ratio": real("(1, inf)", {1.2: "warn when a host makes steps 20% longer"}),
    "train.sample_every": whole("[0, inf)", {0: "no samples"}),
    "train.sample_tokens": _SIZE,
    **{f"mesh.{axis}": _MESH_SIZE for axis in _MESH_AXIS_KEYS},
    **{f"mesh.dcn.{axis}": _SIZE for axis in _MESH_AXIS_KEYS},
    "mesh.auto_memory_gib": real("[0, inf)", {0: "the capacity the memory check uses"}),
    "mesh.auto_trials": whole("[1, inf)", {1: "the planner's first choice, untimed"}),
    "pipeline.microbatches": whole("[0, inf)", {0: "2 x the stages"}),
    "pipeline.repeats": _SIZE,
    "model.vocab_size": _SIZE,
    "model.vocab_multiple": _SIZE,
    "model.d_model": _SIZE,
    "model.n_layers": _SIZE,
    "model.n_heads": _SIZE,
    "model.n_kv_heads": _SIZE,
    "model.head_dim": _SIZE,
    "model.mlp_dim": _SIZE,
    "model.max_seq_len": _SIZE,
    "model.rope_theta": real("(1, inf)", {10000: "Llama 2", 500000: "Llama 3"}),
    "model.rope_scaling.factor": real("[1, inf)"),
    "model.rope_scaling.low_freq_factor": real("(0, inf)"),
    "model.rope_scaling.high_freq_factor": real("(0, inf)"),
    "model.rope_scaling.original_max_seq_len": _SIZE,
    "model.norm_eps": real("(0, inf)"),
    "model.scan_unroll": whole("[0, inf)", {0: "no loop: every layer unrolled",
                                            -1: "chosen for the device"}),
    "model.loss_chunk_len": whole("[0, inf)", {0: "the whole sequence at once",
                                               -1: "chosen for the device"}),
    "model.loss_vocab_tile": whole("[0, inf)", {0: "the whole vocabulary at once",
                                                -1: "chosen for the device"}),
    "model.moe.experts": whole("[0, inf)"),
    "model.moe.top_k": _SIZE,
    "model.moe.capacity_factor": real("[0, inf)", {0: "dropless"}),
    "model.moe.every": whole("[0, inf)", {0: "no MoE layers"}),
    "model.moe.aux_loss_weight": real("[0, inf)", _OFF),
    "model.moe.z_loss_weight": real("[0, inf)", _OFF),
    "model.lora.rank": whole("[0, inf)", {0: "no adapters: full fine-tuning"}),
    "model.lora.alpha": real("(0, inf)"),
    "model.lora.dropout": real("[0, 1)", _OFF),
    "optim.lr": real("(0, inf)"),
    "optim.warmup_steps": whole("[0, inf)"),
    "optim.min_lr_ratio": real("[0, 1]"),  # 1: no decay; the final rate never exceeds optim.lr
    "optim.b1": real("[0, 1)"),  # Adam's decay rates: 1 would never forget the first gradients
    "optim.b2": real("[0, 1)"),
    "optim.eps": real("(0, inf)"),  # 0 divides by zero where a gradient is always 0
    "optim.weight_decay": real("[0, inf)"),
    "optim.grad_clip": real("[0, inf)", {0: "no clipping"}),
    "precision.loss_scale_init": real("(0, inf)"),
    "precision.loss_scale_growth_interval": _SIZE,
    "precision.fp8_amax_history": _SIZE,
    "data.max_segments": whole("[2, inf)", {0: "no bound"}),  # 1: no room for padding
    "data.max_bad_records": whole("[0, inf)", {0: "the first one stops the run"}),
    "data.workers": whole("[0, inf)", {0: "read on the prefetch thread",
                                       -1: "chosen by the tokenizer"}),
    "data.prefetch": whole("[0, inf)", {0: "no prefetching"}),
    "profile.start_step": whole("[0, inf)"),
    "profile.steps": whole("[0, inf)", _OFF),
    "performance.device_memory_gib": real("[0, inf)", {0: "the capacity the backend reports"}),
    "distributed.init_timeout_s": real("(0, inf)"),
    "distributed.heartbeat_timeout_s": real("(0, inf)"),
    "checkpoint.every_steps": whole("[0, inf)", {0: "not by steps"}),
    "checkpoint.every_minutes": real("[0, inf)", {0: "not by time"}),
    "checkpoint.keep": _SIZE,
    "checkpoint.keep_every_steps": whole("[0, inf)", {0: "none kept for good"}),
    "checkpoint.local_every_steps": whole("[0, inf)", {0: "not by steps"}),
    "checkpoint.local_every_minutes": real("[0, inf)", {0: "not by time"}),
    # A RAM disk holds few; a restart compares each process's newest 64 (manager.py).
    "checkpoint.local_keep": whole("[1, 32]"),
}


def _unknown_keys(config: Any, defaults: Any, prefix: str = "") -> list[str]:
    """Keys `config` has that `defaults` lacks; ConfigError when a group lost keys (a config file
    that replaced a whole group, e.g. `c.mesh.dcn = dict(data=2)`)."""
    if prefix and prefix != "sharding.rules.":
        missing = [key for key in defaults.keys() if key not in config]
        if missing:
            raise ConfigError(
                f"config key {prefix + missing[0]!r} is missing: the group {prefix[:-1]!r} was "
                f"replaced whole; set its keys one by one (c.{prefix}{missing[0]} = ...) instead")
    unknown = []
    for key in config.keys():
        path = f"{prefix}{key}"
        if key not in defaults:
            unknown.append(path)
        elif isinstance(defaults[key], ml_collections.ConfigDict) and path != "sharding.rules":
            if not isinstance(config[key], ml_collections.ConfigDict):
                raise ConfigError(f"config key {path!r} must be a group of keys, got "
                                  f"{config[key]!r}")
            unknown += _unknown_keys(config[key], defaults[key], path + ".")
    return unknown


def check_schema(config: ml_collections.ConfigDict) -> None:
    """ConfigError for a key default_config() does not have, or a number not of its kind
    (NUMBERS); needs nothing but the config, so the command line checks it before JAX starts."""
    unknown = _unknown_keys(config, default_config())
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}; check the spelling against "
                          "jaxscale/config.py:default_config()")
    for key, kind in NUMBERS.items():
        value = config
        for name in key.split("."):
            value = value[name]
        problem = kind.problem(value)
        if problem:
            raise ConfigError(f"{key}={value!r} {problem}")


def _check_matmul(precision: ml_collections.ConfigDict) -> None:
    """ConfigError for an unknown `precision.matmul`, or fp8 with a compute dtype it does not
    pair with: fp8 products are dequantized into bfloat16 activations; float16's loss scaling
    and float32's exactness are what fp8 would undo."""
    if precision.matmul not in MATMUL_PRECISIONS:
        raise ConfigError(f"precision.matmul={precision.matmul!r} is unknown; use one of "
                          f"{MATMUL_PRECISIONS}")
    if precision.matmul == "fp8" and precision.compute_dtype != "bfloat16":
        raise ConfigError(f"precision.matmul='fp8' needs precision.compute_dtype='bfloat16', not "
                          f"{precision.compute_dtype!r}; use precision.compute_dtype=bfloat16 or "
                          "precision.matmul=bfloat16")


def check_settings(config: ml_collections.ConfigDict) -> None:
    """ConfigError on the first problem among the config's own values: the schema, then the rules
    between its keys that need nothing else (jaxscale/checks.py adds each component's checks and
    the devices')."""
    check_schema(config)
    t, m = config.train, config.model
    if t.batch_size % t.microbatches:
        raise ConfigError(
            f"train.microbatches={t.microbatches} does not divide train.batch_size="
            f"{t.batch_size}; pick a divisor of {t.batch_size}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                          "lower train.seq_len or raise model.max_seq_len")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads="
                          f"{m.n_heads} (grouped-query attention)")
    _check_rope(m)
    _check_moe(m)
    if config.precision.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"precision.compute_dtype={config.precision.compute_dtype!r} is "
                          f"unknown; use one of {COMPUTE_DTYPES}")
    if config.precision.grad_reduce_dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"precision.grad_reduce_dtype={config.precision.grad_reduce_dtype!r} "
                          "is unknown; use 'float32' or 'bfloat16'")
    _check_matmul(config.precision)
    if config.sharding.optimizer_state not in OPTIMIZER_STATE_LAYOUTS:
        raise ConfigError(f"sharding.optimizer_state={config.sharding.optimizer_state!r} is "
                          f"unknown; use one of {OPTIMIZER_STATE_LAYOUTS} ('data' is ZeRO-1)")
    _check_checkpoint(config)


ROPE_SCALING_TYPES = ("none", "llama3")


def _check_moe(m: ml_collections.ConfigDict) -> None:
    e = m.moe
    if e.every == 0:
        return
    if e.experts < 2:
        raise ConfigError(f"model.moe.experts={e.experts} must be >= 2 when model.moe.every="
                          f"{e.every} makes layers MoE; set the expert count (8 for Mixtral)")
    if e.top_k > e.experts:
        raise ConfigError(f"model.moe.top_k={e.top_k} must be between 1 and model.moe.experts="
                          f"{e.experts} (the experts each token is routed to)")
    if e.capacity_factor > e.experts / e.top_k:
        # Past experts / top_k every expert already has a slot for every token of a row: more
        # slots only cost memory, and 0 (dropless) says "drop nothing" without the buffers.
        raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor} gives every expert "
                          f"more slots than a row has tokens (experts / top_k = "
                          f"{e.experts / e.top_k:g}); set at most {e.experts / e.top_k:g}, or 0 "
                          "for dropless")
    if m.n_layers % e.every:
        raise ConfigError(f"model.moe.every={e.every} does not divide model.n_layers="
                          f"{m.n_layers}; pick a divisor of {m.n_layers} (1: every layer MoE)")


def _check_rope(m: ml_collections.ConfigDict) -> None:
    r = m.rope_scaling
    if r.type not in ROPE_SCALING_TYPES:
        raise ConfigError(f"model.rope_scaling.type={r.type!r} is unknown; use one of "
                          f"{ROPE_SCALING_TYPES}")
    if r.type != "none" and not r.low_freq_factor < r.high_freq_factor:
        raise ConfigError(
            f"model.rope_scaling low_freq_factor={r.low_freq_factor} and high_freq_factor="
            f"{r.high_freq_factor} must satisfy 0 < low < high (Llama 3.1: 1.0 and 4.0)")


def _check_checkpoint(config: ml_collections.ConfigDict) -> None:
    c = config.checkpoint
    if c.keep_every_steps and (not c.every_steps or c.keep_every_steps % c.every_steps):
        raise ConfigError(
            f"checkpoint.keep_every_steps={c.keep_every_steps} must be a multiple of "
            f"checkpoint.every_steps={c.every_steps}, or no saved step would ever be kept; "
            "make it a multiple or set it to 0")
    if "://" in c.local_dir:
        raise ConfigError(f"checkpoint.local_dir={c.local_dir!r} is a URL; the local tier is a "
                          "folder on each host (a RAM disk, a local SSD), the bucket is "
                          "checkpoint.dir")
    for key in ("local_every_steps", "local_every_minutes"):
        if c[key] and not c.local_dir:
            raise ConfigError(f"checkpoint.{key}={c[key]} needs checkpoint.local_dir (the folder "
                              f"on each host to save to); set it, or set checkpoint.{key}=0")
    if c.restore_params_only and not c.restore_from:
        raise ConfigError("checkpoint.restore_params_only=True needs checkpoint.restore_from=PATH "
                          "(the checkpoint whose params to start from)")


