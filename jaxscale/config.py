"""The config's schema and the rules between its own keys.

A config file is a Python file whose `get_config()` returns an `ml_collections.ConfigDict` built on
`default_config()` (loaded by `jaxscale.cli`). The schema is `SCHEMA`: every key declared once,
with its default, what it means in one line and, for a number, its kind (whole or real, its range,
what 0 or -1 means: jaxscale/kinds.py). `default_config()` and `NUMBERS` are read off it, and
tests/test_anatomy.py checks the README's table of keys against it. `check_schema` checks a config
against it without importing anything, and `check_settings` adds the rules between its own keys
(jaxscale/checks.py composes them with each component's checks and the devices'). Each raises
`ConfigError` with the key, the bad value and the fix, before anything is compiled or written.
This module imports nothing of jaxscale but the errors and the kinds of number: everything else
imports it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from jaxscale.errors import ConfigError
from jaxscale.kinds import Number, real, whole

# Multi-process runs: how long `jax.distributed.initialize` waits for every process to join, and
# the seconds without a heartbeat after which JAX declares a process dead and stops the others
# (the bound on how long survivors of a crashed peer keep running).
DEFAULT_INIT_TIMEOUT_S = 300
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
# The mesh's axes, outermost (devices far apart, slow links) to innermost (neighbours on the
# fastest links): jaxscale/parallel/mesh.py lays the devices out in this order, so tensor
# parallelism gets the closest devices. Each has a size key `mesh.<axis>` and a DCN factor
# `mesh.dcn.<axis>`.
MESH_AXES = ("data", "pipeline", "fsdp", "context", "expert", "tensor")
LOGICAL_AXES = (
    "batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
    "experts",
)
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
MATMUL_PRECISIONS = ("bfloat16", "fp8")  # precision.matmul
# sharding.optimizer_state: with each parameter, or also split over the data-parallel axes (ZeRO-1).
OPTIMIZER_STATE_LAYOUTS = ("params", "data")


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key: its default, what it means, and for a number its kind."""
    default: Any
    meaning: str
    kind: Number | None = None


_SIZE = whole("[1, inf)")
_MESH_SIZE = whole("[1, inf)", {-1: "the devices left over"})
_OFF = {0: "off"}
_DEVICE = {-1: "chosen for the device"}  # jaxscale/training/step_settings.py

# Every key jaxscale understands, group by group (a dict is a group of keys). Config files start
# from its defaults (`default_config`); `NUMBERS` is its numbers' kinds.
SCHEMA = {
    "train": {
        "steps": Key(200, "the step the run trains to", _SIZE),
        # JAX's and NumPy's seeds: a non-negative int64.
        "seed": Key(0, "the init's, the data order's and dropout's seed",
                    whole(f"[0, {2 ** 63 - 1}]")),
        "batch_size": Key(16, "sequences per step, over every device", _SIZE),
        "seq_len": Key(128, "tokens per sequence", _SIZE),
        "microbatches": Key(1, "gradient accumulation: the batch goes through in this many parts",
                            _SIZE),
        "log_every": Key(10, "steps between metrics lines", _SIZE),
        "eval_every": Key(100, "steps between evaluations of the eval split",
                          whole("[0, inf)", {0: "no periodic eval"})),
        # An eval of no batches would log a loss of 0.
        "eval_batches": Key(4, "batches of the eval split each evaluation reads", _SIZE),
        "max_bad_steps": Key(20, "non-finite (skipped) steps in a row that stop the run", _SIZE),
        # Metrics step_time_max_host_s, slowest_host, host_time_*.
        "straggler_ratio": Key(
            1.2, "multi-host: warn when the slowest host makes a step this much longer",
            real("(1, inf)", {1.2: "warn when a host makes steps 20% longer"})),
        # Logged as text to every tracker (<workdir>/samples.jsonl, TensorBoard, ...).
        "sample_every": Key(0, "steps between greedy samples of sample_prompts",
                            whole("[0, inf)", {0: "no samples"})),
        "sample_prompts": Key((), "the prompts sampled every sample_every steps"),
        "sample_tokens": Key(32, "new tokens each sample continues its prompt by", _SIZE),
    },
    "mesh": {
        **{axis: Key(-1 if axis == "data" else 1, f"the {axis} axis' size within a slice (ICI)",
                     _MESH_SIZE) for axis in MESH_AXES},
        "dcn": {axis: Key(1, f"the {axis} axis' factor across slices or hosts (DCN)", _SIZE)
                for axis in MESH_AXES},
        # The planner chooses the axis sizes, remat, accumulation and optimizer-state layout at
        # start-up (docs/planning.md).
        "auto": Key(False, "the planner chooses the layout at start-up"),
        # 0: performance.device_memory_gib, or what the device reports (CPUs report none).
        "auto_memory_gib": Key(0.0, "the memory per device mesh.auto plans for",
                               real("[0, inf)", {0: "the capacity the memory check uses"})),
        # A spread of the meshes its estimate cannot tell apart.
        "auto_trials": Key(3, "candidates that fit that mesh.auto times on the devices",
                           whole("[1, inf)", {1: "the planner's first choice, untimed"})),
    },
    # Logical axis name -> tuple of mesh axes it is sharded over (empty: replicated).
    "sharding": {
        "rules": {
            # The dense layers stay data-parallel over the expert axis.
            "batch": Key(("data", "fsdp", "expert"), "rows: over the data-parallel axes"),
            "length": Key(("context",), "long sequences: activations split along them"),
            "embed": Key(("fsdp",), "the model dimension: parameters split over fsdp"),
            "heads": Key(("tensor",), "attention heads: tensor parallelism"),
            "kv_heads": Key(("tensor",), "key/value heads: tensor parallelism"),
            "head_dim": Key((), "each head's dimension: not split"),
            "mlp": Key(("tensor",), "the feed-forward's hidden units: tensor parallelism"),
            "vocab": Key(("tensor",), "the vocabulary: tensor parallelism"),
            "layers": Key(("pipeline",), "pipeline stages hold consecutive layers"),
            "experts": Key(("expert",), "the experts of an MoE layer (model.moe)"),
        },
        # docs/parallelism.md.
        "optimizer_state": Key("params", "where the optimizer state lives: params (with each "
                               "parameter) | data (ZeRO-1: also over the data axes)"),
    },
    # docs/parallelism.md.
    "pipeline": {
        "microbatches": Key(0, "the parts a step's batch goes through the stages in",
                            whole("[0, inf)", {0: "2 x the stages"})),
        "repeats": Key(1, "groups of layers each stage holds (circular)", _SIZE),
        "schedule": Key("gpipe", "gpipe | 1f1b (repeats 1)"),
    },
    "model": {
        "name": Key("", "the model family (jaxscale/models/__init__.py FAMILIES; \"\": its "
                    "DEFAULT_FAMILY)"),
        "vocab_size": Key(259, "the tokenizer's ids (the byte tokenizer's: 256 + pad, bos, eos)",
                          _SIZE),
        "vocab_multiple": Key(128, "the embedding's rows are padded to a multiple of this",
                              _SIZE),
        "d_model": Key(256, "the model dimension", _SIZE),
        "n_layers": Key(4, "decoder layers", _SIZE),
        "n_heads": Key(8, "query heads", _SIZE),
        "n_kv_heads": Key(4, "key/value heads (grouped-query attention)", _SIZE),
        "head_dim": Key(32, "each head's dimension", _SIZE),
        "mlp_dim": Key(768, "the SwiGLU feed-forward's hidden units", _SIZE),
        "max_seq_len": Key(2048, "the longest context the model is for", _SIZE),
        "sliding_window": Key(0, "the tokens each query attends to, itself included",
                              whole("[0, inf)", {0: "every earlier token"})),
        # Layers that differ (Gemma 3's local and global ones): jaxscale/models/decoder.py.
        "global_every": Key(0, "layers (i + 1) a multiple of this are global: every earlier "
                            "token, rope_theta; the others local: sliding_window, "
                            "rope_local_theta", whole("[0, inf)", {0: "every layer alike"})),
        "rope_local_theta": Key(0.0, "the local layers' RoPE base wavelength (global_every)",
                                real("[0, inf)", {0: "rope_theta"})),
        "query_pre_attn_scalar": Key(0, "the attention scores are scaled by its -1/2 power",
                                     whole("[0, inf)", {0: "head_dim"})),
        "rope_theta": Key(10000.0, "RoPE's base wavelength",
                          real("(1, inf)", {10000: "Llama 2", 500000: "Llama 3"})),
        # Hugging Face rope_type "llama3"; the other keys are read for llama3 only, their defaults
        # Llama 3.1's.
        "rope_scaling": {
            "type": Key("none", "RoPE frequency scaling: none | llama3 (Llama 3.1+) | linear "
                                "(Gemma 3 4B+'s global layers: factor only)"),
            "factor": Key(8.0, "how much long wavelengths are stretched", real("[1, inf)")),
            "low_freq_factor": Key(1.0, "wavelengths past original / this are stretched",
                                   real("(0, inf)")),
            "high_freq_factor": Key(4.0, "wavelengths below original / this are kept",
                                    real("(0, inf)")),
            "original_max_seq_len": Key(8192, "the context pre-training had", _SIZE),
        },
        "norm_eps": Key(1e-5, "RMSNorm's epsilon", real("(0, inf)")),
        "tie_embeddings": Key(False, "the head is the embedding's transpose"),
        "remat": Key("none", "what the backward pass recomputes: none | full | save_dots"),
        # jaxscale/parallel/attention.py.
        "attention": Key("auto", "the attention kernel: auto (splash on TPU, cudnn on GPU, else "
                         "xla) | xla | splash | cudnn"),
        # How the step runs (jaxscale/training/step_settings.py): the same loss either way; -1:
        # chosen for the device (GPUs: unrolled, whole logits where that fits; TPUs and CPUs: a
        # loop, 1024 positions x 16384 entries).
        "scan_unroll": Key(-1, "layers per turn of the layer loop (lax.scan's unroll)",
                           whole("[0, inf)", {0: "no loop: every layer unrolled", **_DEVICE})),
        "loss_chunk_len": Key(-1, "sequence positions whose float32 logits the loss holds at "
                              "once", whole("[0, inf)", {0: "the whole sequence at once",
                                                         **_DEVICE})),
        "loss_vocab_tile": Key(-1, "vocabulary entries whose float32 logits the loss holds at "
                               "once", whole("[0, inf)", {0: "the whole vocabulary at once",
                                                          **_DEVICE})),
        # Mixture of experts (jaxscale/models/moe.py): each expert takes capacity_factor x an even
        # share of a sequence's tokens, the rest dropped (0: dropless, grouped matmuls over every
        # assignment).
        "moe": {
            "experts": Key(0, "SwiGLU experts of mlp_dim in an MoE layer", whole("[0, inf)")),
            "top_k": Key(2, "the experts each token is routed to", _SIZE),
            "capacity_factor": Key(1.25, "each expert's slots, in even shares of the tokens",
                                   real("[0, inf)", {0: "dropless"})),
            "every": Key(0, "every every-th layer's feed-forward is MoE",
                         whole("[0, inf)", {0: "no MoE layers"})),
            "aux_loss_weight": Key(0.01, "the load-balancing loss's weight in the training loss",
                                   real("[0, inf)", _OFF)),
            "z_loss_weight": Key(0.001, "the router z-loss's weight in the training loss",
                                 real("[0, inf)", _OFF)),
        },
        # LoRA (jaxscale/models/lora.py, docs/finetuning.md): everything else frozen in the
        # compute dtype; the base is checkpoint.restore_from (a Hugging Face folder or a run),
        # else the init.
        "lora": {
            "rank": Key(0, "the adapters' rank", whole("[0, inf)", {0: "no adapters: full "
                                                                    "fine-tuning"})),
            "alpha": Key(16.0, "each adapter adds (alpha / rank) x A B to its weight",
                         real("(0, inf)")),
            "dropout": Key(0.0, "train step only: an adapter input's elements zeroed with this "
                           "probability (PEFT's lora_dropout)", real("[0, 1)", _OFF)),
            "targets": Key(("q", "k", "v", "o", "gate", "up", "down"),
                           "the weights with adapters: q k v o gate up down"),
        },
    },
    "optim": {
        "lr": Key(3e-3, "the peak learning rate", real("(0, inf)")),
        "warmup_steps": Key(20, "steps of linear warm-up to lr", whole("[0, inf)")),
        # 1: no decay; the final rate never exceeds optim.lr.
        "min_lr_ratio": Key(0.1, "cosine reaches lr x this at the last step", real("[0, 1]")),
        # Adam's decay rates: 1 would never forget the first gradients.
        "b1": Key(0.9, "Adam's first moment decay", real("[0, 1)")),
        "b2": Key(0.95, "Adam's second moment decay", real("[0, 1)")),
        # 0 divides by zero where a gradient is always 0.
        "eps": Key(1e-8, "Adam's epsilon", real("(0, inf)")),
        "weight_decay": Key(0.1, "decoupled weight decay, not on norms and biases",
                            real("[0, inf)")),
        "grad_clip": Key(1.0, "global-norm clipping", real("[0, inf)", {0: "no clipping"})),
        # The update is computed in float32; see docs/performance.md for nu's precision.
        "moment_dtype": Key("float32", "Adam's moments' storage dtype: float32 | bfloat16"),
        "offload_state": Key(False, "keep the moments in host memory, streamed to the device for "
                             "the update"),
    },
    "precision": {
        "compute_dtype": Key("bfloat16", "matmuls and activations (parameters and optimizer "
                             "state stay float32): bfloat16 | float32 | float16"),
        # bfloat16: 2 bytes a parameter on the wire, each partial sum rounded to bfloat16; moot
        # with float32 compute, float32 either way with float16 compute. It moved tiny's loss less
        # than reordering float32 sums does: docs/performance.md.
        "grad_reduce_dtype": Key("bfloat16", "the dtype weight gradients are made and summed "
                                 "over data-parallel devices in: bfloat16 | float32"),
        # fp8: e4m3 forward, e5m2 gradients, per-tensor delayed scaling; needs bfloat16 compute
        # and, on a GPU, compute capability 8.9+. The head, attention and loss stay as they are.
        "matmul": Key("bfloat16", "the attention and dense feed-forward weight matmuls: "
                      "bfloat16 (the compute dtype) | fp8"),
        "fp8_amax_history": Key(16, "fp8: the steps of amax history each scale is set from",
                                _SIZE),
        "loss_scale_init": Key(2.0 ** 15, "float16 only: the dynamic loss scale's start",
                               real("(0, inf)")),
        "loss_scale_growth_interval": Key(2000, "float16 only: good steps before the scale "
                                          "doubles", _SIZE),
    },
    # docs/data.md: the source formats and their keys.
    "data": {
        # stdlib (this Python's own .py files), synthetic (random tokens), text, jsonl, parquet,
        # array_record, tokens (from jaxscale.data.prepare), chat (conversations or
        # prompt/completion pairs: the loss on the replies only).
        "sources": Key((dict(format="stdlib"),), "a tuple of dicts, mixed by their weight"),
        "tokenizer": Key("byte", "byte | a SentencePiece .model | a Hugging Face "
                         "tokenizer.json"),
        "add_bos": Key(True, "frame each document with BOS"),
        "add_eos": Key(True, "and EOS"),
        "bos_token": Key("", "a learned tokenizer's BOS token (\"\": its own)"),
        "eos_token": Key("", "a learned tokenizer's EOS token (\"\": its own)"),
        # auto: first_fit when a source is chat data (a conversation must not be cut), else concat.
        "packing": Key("auto", "concat (concat-then-split, no padding) | first_fit (whole "
                       "documents) | auto"),
        # A row with more is cut into several, padded. A bound puts packed rows in cuDNN's packed
        # layout on GPUs: faster attention, a workspace that grows with it. 1: no room for
        # padding.
        "max_segments": Key(0, "the most runs (documents, padding one) a packed row holds",
                            whole("[2, inf)", {0: "no bound"})),
        "max_bad_records": Key(100, "malformed records a process skips before the run fails",
                               whole("[0, inf)", {0: "the first one stops the run"})),
        # Batches are the same for any value.
        "workers": Key(-1, "threads reading and tokenizing the row streams",
                       whole("[0, inf)", {0: "read on the prefetch thread",
                                          -1: "chosen by the tokenizer"})),
        "prefetch": Key(2, "batches prepared ahead of the step",
                        whole("[0, inf)", {0: "no prefetching"})),
        # Batches are the same for any value.
        "read_ahead": Key(4, "documents each row stream reads ahead of its rows from a bucket, "
                             "on a thread of its own",
                          whole("[0, inf)", {0: "each read when its row needs it"})),
    },
    # A jax.profiler trace in <workdir>/profile/ (docs/performance.md).
    "profile": {
        "start_step": Key(10, "the first step traced", whole("[0, inf)")),
        "steps": Key(0, "steps traced", whole("[0, inf)", _OFF)),
        "all_processes": Key(False, "every process traces (else process 0 only)"),
    },
    # Where process 0 sends the metrics besides the console (README, Reading the metrics); wandb
    # and mlflow: pip install 'jaxscale[wandb]' / 'jaxscale[mlflow]'.
    "metrics": {
        "trackers": Key(("jsonl", "tensorboard"), "any of jsonl, tensorboard, wandb, mlflow"),
        "tensorboard_dir": Key("", "TensorBoard's event files: a folder or gs://, s3:// (\"\": "
                               "<workdir>/tensorboard)"),
        "project": Key("jaxscale", "the W&B project and the MLflow experiment"),
        "wandb_mode": Key("", "online | offline | \"\" (W&B's own: WANDB_MODE, else online)"),
        "mlflow_tracking_uri": Key("", "\"\": MLFLOW_TRACKING_URI, else "
                                   "file://<workdir>/mlruns"),
    },
    "performance": {
        # jaxscale/runtime/xla_flags.py; flags already in the XLA_FLAGS environment variable win.
        "xla_flags": Key("auto", "auto (a tuned set on NVIDIA GPUs) | none | a string of "
                         "--xla_... flags"),
        # CPUs report none, so unchecked.
        "device_memory_gib": Key(0.0, "what one device holds, which the compiled step must fit",
                                 real("[0, inf)", {0: "the capacity the backend reports"})),
    },
    # Multi-process runs (docs/launch.md).
    "distributed": {
        "init_timeout_s": Key(DEFAULT_INIT_TIMEOUT_S, "how long to wait for every process to "
                              "join", real("(0, inf)")),
        "heartbeat_timeout_s": Key(DEFAULT_HEARTBEAT_TIMEOUT_S, "how long a silent process may "
                                   "go before the others are stopped", real("(0, inf)")),
    },
    # docs/checkpointing.md.
    "checkpoint": {
        "enabled": Key(True, "the run saves and restores checkpoints"),
        "dir": Key("", "where (\"\": <workdir>/checkpoints); any path Orbax writes (local, "
                   "gs://...)"),
        "every_steps": Key(100, "save when the step is a multiple",
                           whole("[0, inf)", {0: "not by steps"})),
        "every_minutes": Key(0.0, "save when this long has passed since the last save",
                             real("[0, inf)", {0: "not by time"})),
        "keep": Key(3, "the newest checkpoints kept", _SIZE),
        "keep_every_steps": Key(0, "also keep for good each checkpoint whose step is a multiple",
                                whole("[0, inf)", {0: "none kept for good"})),
        # The local tier (docs/checkpointing.md, Two tiers): also saved on SIGTERM.
        "local_dir": Key("", "a folder on each host for the local tier (a RAM disk, a local SSD; "
                         "\"\": none)"),
        "local_every_steps": Key(0, "save to the local tier when the step is a multiple",
                                 whole("[0, inf)", {0: "not by steps"})),
        "local_every_minutes": Key(0.0, "save to the local tier when this long has passed",
                                   real("[0, inf)", {0: "not by time"})),
        # A RAM disk holds few; a restart compares each process's newest 64 (manager.py).
        "local_keep": Key(2, "the newest local checkpoints kept", whole("[1, 32]")),
        # Its workdir, checkpoint folder or one step folder, or a Hugging Face folder.
        "restore_from": Key("", "start from another run's checkpoint when this run has none"),
        "restore_params_only": Key(False, "with restore_from: its params only (fine-tuning), "
                                   "from step 0"),
        "compilation_cache": Key(True, "JAX's persistent compilation cache: restarts skip "
                                 "compiling"),
        "compilation_cache_dir": Key("", "\"\": <workdir>/compilation_cache"),
    },
}


def _defaults(group: dict) -> dict:
    return {name: _defaults(key) if isinstance(key, dict) else key.default
            for name, key in group.items()}


def declared_keys(group: dict = SCHEMA, prefix: str = "") -> dict[str, Key]:
    """{"train.steps": its Key, ...}: every key of `group` (default: the whole schema)."""
    keys = {}
    for name, key in group.items():
        if isinstance(key, dict):
            keys.update(declared_keys(key, f"{prefix}{name}."))
        else:
            keys[f"{prefix}{name}"] = key
    return keys


def default_config() -> ml_collections.ConfigDict:
    """Every key jaxscale understands, with its default (`SCHEMA`). Config files start from this."""
    return ml_collections.ConfigDict(_defaults(SCHEMA))


# The kind of every number in the schema: `check_schema` checks them before anything else (the
# command line as soon as it has read the flags).
NUMBERS = {path: key.kind for path, key in declared_keys().items() if key.kind is not None}


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


ROPE_SCALING_TYPES = ("none", "llama3", "linear")


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
    if r.type == "llama3" and not r.low_freq_factor < r.high_freq_factor:
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


