"""Config defaults and validation.

A config file is a Python file whose `get_config()` returns an `ml_collections.ConfigDict` built on
`default_config()` (loaded by `jaxscale.cli`). Every check a user's config must pass lives in
`validate`, which raises `ConfigError` with the key, the bad value and the fix, before anything is
compiled or written.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

from jaxscale.distributed import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_INIT_TIMEOUT_S
from jaxscale.errors import ConfigError

# Outermost (devices far apart, slow links) to innermost (neighbours on the fastest links): the
# device mesh is laid out in this order, so tensor parallelism gets the closest devices.
MESH_AXES = ("data", "pipeline", "fsdp", "context", "expert", "tensor")
LOGICAL_AXES = (
    "batch", "length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers",
    "experts",
)
COMPUTE_DTYPES = ("bfloat16", "float32", "float16")
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
    )
    # Mesh axis sizes within a slice (ICI); -1 takes the devices left over. `dcn` multiplies an axis
    # across slices / hosts connected by the data-centre network.
    c.mesh = dict(data=-1, fsdp=1, tensor=1, pipeline=1, expert=1, context=1,
                  dcn=dict(data=1, fsdp=1, tensor=1, pipeline=1, expert=1, context=1),
                  # True: the planner chooses the sizes above, the remat policy, accumulation and
                  # optimizer-state layout at start-up (docs/planning.md), planning for
                  # auto_memory_gib GiB per device (0: the capacity the memory check uses,
                  # performance.device_memory_gib or what the device reports; CPUs have none),
                  # and times its auto_trials fastest-ranked candidates that fit for a few steps
                  # on the devices (1: trusts its ranking).
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
        name="llama",
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
        # Sequence positions whose float32 logits the loss holds at once (0: the whole
        # sequence); smaller saves memory per device at large vocabularies, same loss.
        loss_chunk_len=1024,
        # Mixture of experts (jaxscale/models/moe.py): every `every`-th layer's feed-forward is
        # `experts` SwiGLU experts of mlp_dim, each token routed to its top_k (0: all dense).
        # Each expert takes capacity_factor x an even share of a sequence's tokens; the rest
        # are dropped. The training loss adds aux_loss_weight x the load-balancing loss and
        # z_loss_weight x the router z-loss.
        moe=dict(experts=0, top_k=2, capacity_factor=1.25, every=0, aux_loss_weight=0.01,
                 z_loss_weight=0.001),
    )
    c.optim = dict(
        lr=3e-3,
        warmup_steps=20,
        min_lr_ratio=0.1,  # cosine decays to lr * min_lr_ratio at train.steps
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
        # Dynamic loss scaling, used only with float16 compute.
        loss_scale_init=2.0 ** 15,
        loss_scale_growth_interval=2000,
    )
    # See docs/data.md for the source formats and their keys.
    c.data = dict(
        # A tuple of dicts, mixed by `weight`: stdlib (this Python's own .py files), synthetic
        # (random tokens), text, jsonl, parquet, array_record, tokens (from jaxscale.data.prepare).
        sources=(dict(format="stdlib"),),
        tokenizer="byte",  # byte | a SentencePiece .model | a Hugging Face tokenizer.json
        add_bos=True,  # frame each document as BOS + text + EOS
        add_eos=True,
        bos_token="",  # a learned tokenizer's BOS/EOS token; "" = its own (SentencePiece)
        eos_token="",
        packing="concat",  # concat (concat-then-split, no padding) | first_fit (whole documents)
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
    # XLA flags: "auto" (a tuned set on NVIDIA GPUs; jaxscale/xla_flags.py), "none", or a string of
    # "--xla_...=..." flags. Flags already in the XLA_FLAGS environment variable win.
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
        # Start from another run's checkpoint (its workdir, checkpoint folder or one step folder)
        # when this run has none of its own yet.
        restore_from="",
        restore_params_only=False,  # with restore_from: params only (fine-tuning), from step 0
        compilation_cache=True,  # JAX's persistent compilation cache: restarts skip compiling
        compilation_cache_dir="",  # "" -> <workdir>/compilation_cache
    )
    return c


def logical_axis_sizes(config: ml_collections.ConfigDict) -> dict[str, int]:
    """The length of each logical axis under `config`, used to check it divides its mesh axes."""
    from jaxscale.state import model_config  # imports JAX; validation needs it anyway

    m, t = config.model, config.train
    return dict(
        batch=t.batch_size // max(t.microbatches, 1),  # what one microbatch shards
        length=t.seq_len,
        embed=m.d_model,
        heads=m.n_heads,
        kv_heads=m.n_kv_heads,
        head_dim=m.head_dim,
        mlp=m.mlp_dim,
        vocab=model_config(config).padded_vocab_size,
        layers=m.n_layers,
        experts=m.moe.experts,
    )


def resolve_mesh_shape(mesh: ml_collections.ConfigDict, num_devices: int,
                       num_slices: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """Returns (ici, dcn) axis sizes with every -1 filled in.

    `num_slices` is how many DCN-connected granules (slices or hosts) the devices form; their
    product of `mesh.dcn.*` must equal it, and the ICI sizes must fill one granule.
    """
    dcn = {a: int(mesh.dcn[a]) for a in MESH_AXES}
    for a, v in dcn.items():
        if v < 1:
            raise ConfigError(f"mesh.dcn.{a}={v} must be >= 1")
    if math.prod(dcn.values()) != num_slices:
        raise ConfigError(
            f"mesh.dcn sizes {dcn} multiply to {math.prod(dcn.values())} but there are "
            f"{num_slices} slices/hosts; make their product {num_slices}")
    per_slice = num_devices // num_slices
    ici = {a: int(mesh[a]) for a in MESH_AXES}
    free = [a for a, v in ici.items() if v == -1]
    for a, v in ici.items():
        if v == 0 or v < -1:
            raise ConfigError(f"mesh.{a}={v} must be a positive size or -1 (take the rest)")
    if len(free) > 1:
        raise ConfigError(f"mesh axes {free} are all -1; at most one axis may take the rest")
    fixed = math.prod(v for v in ici.values() if v != -1)
    if free:
        if per_slice % fixed:
            raise ConfigError(
                f"mesh sizes {ici} leave no whole size for mesh.{free[0]}: {per_slice} devices "
                f"per slice are not divisible by {fixed}; change the fixed mesh sizes")
        ici[free[0]] = per_slice // fixed
    if math.prod(ici.values()) != per_slice:
        raise ConfigError(
            f"mesh sizes {ici} multiply to {math.prod(ici.values())} but there are {per_slice} "
            f"devices{' per slice' if num_slices > 1 else ''}; make the product {per_slice} or "
            "set one axis to -1")
    return ici, dcn


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


def _check_positive(config, *keys: str) -> None:
    for key in keys:
        group, name = key.split(".")
        value = config[group][name]
        if not value > 0:
            raise ConfigError(f"{key}={value!r} must be > 0")


def validate(config: ml_collections.ConfigDict, num_devices: int, num_slices: int = 1
             ) -> tuple[dict[str, int], dict[str, int]]:
    """Raises ConfigError on the first problem in `config` for a run on `num_devices` devices in
    `num_slices` DCN-connected granules; returns the mesh's (ici, dcn) axis sizes."""
    unknown = _unknown_keys(config, default_config())
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}; check the spelling against "
                          "jaxscale/config.py:default_config()")
    _check_positive(config, "train.steps", "train.batch_size", "train.seq_len",
                    "train.microbatches", "train.log_every", "optim.lr", "model.vocab_size",
                    "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads",
                    "model.head_dim", "model.mlp_dim", "model.vocab_multiple")
    t, m = config.train, config.model
    if t.eval_every < 0 or t.eval_batches < 0:
        raise ConfigError("train.eval_every and train.eval_batches must be >= 0")
    if not t.straggler_ratio > 1:
        raise ConfigError(f"train.straggler_ratio={t.straggler_ratio} must be > 1 (1.2: warn when "
                          "the slowest host makes each step 20% longer)")
    if not 0 <= config.optim.warmup_steps:
        raise ConfigError(f"optim.warmup_steps={config.optim.warmup_steps} must be >= 0")
    if not 0 <= config.optim.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={config.optim.min_lr_ratio} must be in [0, 1]")
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
    if m.name != "llama":
        raise ConfigError(f"model.name={m.name!r} is unknown; the available model is 'llama'")
    from jaxscale.models import REMAT_POLICIES  # imports JAX; validation needs it anyway

    if m.remat not in REMAT_POLICIES:
        raise ConfigError(f"model.remat={m.remat!r} is unknown; use one of "
                          f"{tuple(REMAT_POLICIES)}")
    from jaxscale.parallel.attention import IMPLEMENTATIONS

    if m.attention not in IMPLEMENTATIONS:
        raise ConfigError(f"model.attention={m.attention!r} is unknown; use one of "
                          f"{IMPLEMENTATIONS}")
    if m.loss_chunk_len < 0:
        raise ConfigError(f"model.loss_chunk_len={m.loss_chunk_len} must be >= 0 (0: the whole "
                          "sequence's logits at once)")
    if config.precision.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"precision.compute_dtype={config.precision.compute_dtype!r} is "
                          f"unknown; use one of {COMPUTE_DTYPES}")
    _check_data(config)
    _check_performance(config)
    for key in ("init_timeout_s", "heartbeat_timeout_s"):
        if not config.distributed[key] > 0:
            raise ConfigError(f"distributed.{key}={config.distributed[key]} must be > 0 seconds")
    _check_checkpoint(config)

    ici, dcn = resolve_mesh_shape(config.mesh, num_devices, num_slices)
    mesh_shape = {a: ici[a] * dcn[a] for a in MESH_AXES}
    _check_pipeline(config, mesh_shape)  # first: its errors name the pipeline's own keys
    _check_experts(config, mesh_shape)
    _check_context(config, mesh_shape)
    _check_rules(config, mesh_shape)
    return ici, dcn


ROPE_SCALING_TYPES = ("none", "llama3")


def _check_moe(m: ml_collections.ConfigDict) -> None:
    e = m.moe
    if e.every < 0:
        raise ConfigError(f"model.moe.every={e.every} must be >= 0 (0: no MoE layers; n: every "
                          "n-th layer is MoE)")
    if e.every == 0:
        return
    if e.experts < 2:
        raise ConfigError(f"model.moe.experts={e.experts} must be >= 2 when model.moe.every="
                          f"{e.every} makes layers MoE; set the expert count (8 for Mixtral)")
    if not 1 <= e.top_k <= e.experts:
        raise ConfigError(f"model.moe.top_k={e.top_k} must be between 1 and model.moe.experts="
                          f"{e.experts} (the experts each token is routed to)")
    if m.n_layers % e.every:
        raise ConfigError(f"model.moe.every={e.every} does not divide model.n_layers="
                          f"{m.n_layers}; pick a divisor of {m.n_layers} (1: every layer MoE)")
    if not e.capacity_factor > 0:
        raise ConfigError(f"model.moe.capacity_factor={e.capacity_factor} must be > 0 (1.25: "
                          "each expert takes 1.25 x an even share of the tokens)")
    for key in ("aux_loss_weight", "z_loss_weight"):
        if e[key] < 0:
            raise ConfigError(f"model.moe.{key}={e[key]} must be >= 0 (0 turns it off)")


def _check_rope(m: ml_collections.ConfigDict) -> None:
    r = m.rope_scaling
    if not m.rope_theta > 1:
        raise ConfigError(f"model.rope_theta={m.rope_theta} must be > 1 (10000.0 for Llama 2, "
                          "500000.0 for Llama 3)")
    if r.type not in ROPE_SCALING_TYPES:
        raise ConfigError(f"model.rope_scaling.type={r.type!r} is unknown; use one of "
                          f"{ROPE_SCALING_TYPES}")
    if r.type == "none":
        return
    if not r.factor >= 1:
        raise ConfigError(f"model.rope_scaling.factor={r.factor} must be >= 1 (how much longer "
                          "the context is than original_max_seq_len; 8 for Llama 3.1)")
    if not 0 < r.low_freq_factor < r.high_freq_factor:
        raise ConfigError(
            f"model.rope_scaling low_freq_factor={r.low_freq_factor} and high_freq_factor="
            f"{r.high_freq_factor} must satisfy 0 < low < high (Llama 3.1: 1.0 and 4.0)")
    if not r.original_max_seq_len > 0:
        raise ConfigError(f"model.rope_scaling.original_max_seq_len={r.original_max_seq_len} "
                          "must be > 0 (the pre-training context, 8192 for Llama 3.1)")


def _check_data(config: ml_collections.ConfigDict) -> None:
    # Imported here: the data package pulls in grain, which config loading does not need.
    from jaxscale.data.packing import METHODS
    from jaxscale.data.sources import source_specs
    from jaxscale.data.tokenizers import tokenizer_from_config

    d, m = config.data, config.model
    source_specs(config)
    if d.packing not in METHODS:
        raise ConfigError(f"data.packing={d.packing!r} is unknown; use one of {METHODS}")
    if d.workers < -1:
        raise ConfigError(f"data.workers={d.workers} must be >= 0 reader threads (0 reads on the "
                          "prefetch thread) or -1 (chosen by tokenizer)")
    if d.max_bad_records < 0:
        raise ConfigError(f"data.max_bad_records={d.max_bad_records} must be >= 0 (0: the first "
                          "malformed record stops the run)")
    if d.prefetch < 0:
        raise ConfigError(f"data.prefetch={d.prefetch} must be >= 0 (0 disables prefetching)")
    if d.max_segments == 1 or d.max_segments < 0:
        raise ConfigError(f"data.max_segments={d.max_segments} must be 0 (no bound) or >= 2 (a "
                          "document and the padding after it)")
    vocab = tokenizer_from_config(config).vocab_size
    if vocab > m.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's "
                          f"{vocab} ids; set model.vocab_size >= {vocab}")


def _check_performance(config: ml_collections.ConfigDict) -> None:
    """The profile window, the XLA flags setting, the device memory override and the optimizer's
    memory options."""
    from jaxscale.device_memory import check_device_memory_gib
    from jaxscale.optim import check_memory_options
    from jaxscale.profiling import check_window
    from jaxscale.xla_flags import check_setting

    check_window(config.profile, config.train.steps)
    check_setting(config.performance.xla_flags)
    check_device_memory_gib(config.performance.device_memory_gib)
    check_memory_options(config.optim)


def _check_checkpoint(config: ml_collections.ConfigDict) -> None:
    c = config.checkpoint
    if config.train.max_bad_steps < 1:
        raise ConfigError(f"train.max_bad_steps={config.train.max_bad_steps} must be >= 1")
    for key in ("every_steps", "every_minutes", "keep_every_steps"):
        if c[key] < 0:
            raise ConfigError(f"checkpoint.{key}={c[key]} must be >= 0 (0 turns it off)")
    if c.keep < 1:
        raise ConfigError(f"checkpoint.keep={c.keep} must be >= 1: the newest checkpoint is the "
                          "one a restart resumes from")
    if c.keep_every_steps and (not c.every_steps or c.keep_every_steps % c.every_steps):
        raise ConfigError(
            f"checkpoint.keep_every_steps={c.keep_every_steps} must be a multiple of "
            f"checkpoint.every_steps={c.every_steps}, or no saved step would ever be kept; "
            "make it a multiple or set it to 0")
    if c.restore_params_only and not c.restore_from:
        raise ConfigError("checkpoint.restore_params_only=True needs checkpoint.restore_from=PATH "
                          "(the checkpoint whose params to start from)")


PIPELINE_SCHEDULES = ("gpipe", "1f1b")


def _check_pipeline(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    p, t = config.pipeline, config.train
    if p.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"pipeline.schedule={p.schedule!r} is unknown; use one of "
                          f"{PIPELINE_SCHEDULES}")
    if p.repeats < 1 or p.microbatches < 0:
        raise ConfigError(f"pipeline.repeats={p.repeats} must be >= 1 and pipeline.microbatches="
                          f"{p.microbatches} >= 0 (0: twice the stages)")
    stages = mesh_shape["pipeline"]
    if stages == 1:
        return
    if config.model.attention == "cudnn":
        raise ConfigError(f"model.attention='cudnn' cannot run in mesh.pipeline={stages} stages: "
                          "JAX's cuDNN attention has no batching rule for the stages' vmap; use "
                          "model.attention=auto (XLA's attention there) or xla")
    if config.model.moe.every:
        raise ConfigError(f"mesh.pipeline={stages} with MoE layers (model.moe.every="
                          f"{config.model.moe.every}) is not supported yet; set mesh.pipeline=1 "
                          "and shard the experts with fsdp/tensor")
    rules = config.sharding.rules
    if tuple(rules.get("layers", ())) != ("pipeline",):
        raise ConfigError(f"mesh.pipeline={stages} needs sharding.rules.layers=('pipeline',) "
                          f"(the stages hold the layers), got {tuple(rules.get('layers', ()))}")
    if "pipeline" in {a for name, axes in rules.items() if name != "layers" for a in axes}:
        raise ConfigError("sharding.rules: only 'layers' may name the pipeline mesh axis")
    layers, repeats = config.model.n_layers, p.repeats
    if layers % (stages * repeats):
        raise ConfigError(
            f"model.n_layers={layers} is not divisible by mesh.pipeline x pipeline.repeats = "
            f"{stages} x {repeats}; pick stages and repeats whose product divides {layers}")
    if p.schedule == "1f1b" and repeats > 1:
        raise ConfigError(f"pipeline.schedule='1f1b' runs one group of layers per stage, got "
                          f"pipeline.repeats={repeats}; use repeats=1, or schedule='gpipe' for "
                          "circular repeats")
    micro = p.microbatches or 2 * stages
    rows = t.batch_size // t.microbatches
    if micro < stages:
        raise ConfigError(f"pipeline.microbatches={micro} is fewer than the {stages} stages; "
                          f"use at least {stages} (2 x stages or more keeps the bubble small)")
    batch_shards = math.prod(mesh_shape[a] for a in rules.get("batch", ()))
    if rows % (micro * batch_shards):
        raise ConfigError(
            f"pipeline.microbatches={micro} does not split the {rows} sequences of each step"
            f"{' part' if t.microbatches > 1 else ''} into parts of a multiple of the "
            f"{batch_shards} batch shards; make train.batch_size / train.microbatches a "
            f"multiple of {micro * batch_shards}")


def _check_experts(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """The expert mesh axis: MoE layers to split, experts it divides, and rows split over it too
    (the all-to-all of jaxscale/parallel/experts.py trades rows for experts)."""
    degree, moe = mesh_shape["expert"], config.model.moe
    if degree == 1:
        return
    where = f"mesh.expert x mesh.dcn.expert = {degree}"
    if not moe.every:
        raise ConfigError(f"{where} but the model has no MoE layers (model.moe.every=0); set "
                          "mesh.expert=1 (and mesh.dcn.expert=1), or make layers MoE")
    if moe.experts % degree:
        raise ConfigError(f"model.moe.experts={moe.experts} is not divisible by {where}; pick an "
                          f"expert degree that divides {moe.experts}")
    rules = config.sharding.rules
    experts, batch = tuple(rules.get("experts", ())), tuple(rules.get("batch", ()))
    if experts != ("expert",) or "expert" not in batch:
        raise ConfigError(f"{where} needs sharding.rules.experts=('expert',) and the expert axis "
                          f"in sharding.rules.batch (the rows trade places with the experts), got "
                          f"experts={experts} and batch={batch}")


def _check_context(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    """The sequence split over the axes of sharding.rules.length (mesh.context by default)."""
    axes = tuple(config.sharding.rules.get("length", ()))
    shards = math.prod(mesh_shape[a] for a in axes if a in mesh_shape)
    if shards == 1:
        return
    where = "x".join(f"mesh.{a}={mesh_shape[a]}" for a in axes if a in mesh_shape)
    seq_len = config.train.seq_len
    if seq_len % (2 * shards):
        raise ConfigError(
            f"train.seq_len={seq_len} is not divisible by 2 x {where} = {2 * shards}: the "
            f"sequence is cut into {2 * shards} chunks for a load-balanced causal attention; "
            f"make train.seq_len a multiple of {2 * shards}")
    if config.model.attention == "splash":
        raise ConfigError(
            f"model.attention='splash' needs whole sequences on each device, but {where} splits "
            "them (sharding.rules.length); use model.attention=auto, xla or (GPUs) cudnn")


def _check_rules(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> None:
    layout = config.sharding.optimizer_state
    if layout not in OPTIMIZER_STATE_LAYOUTS:
        raise ConfigError(f"sharding.optimizer_state={layout!r} is unknown; use one of "
                          f"{OPTIMIZER_STATE_LAYOUTS} ('data' is ZeRO-1)")
    rules = config.sharding.rules
    for name in rules.keys():
        if name not in LOGICAL_AXES:
            raise ConfigError(f"sharding.rules has unknown logical axis {name!r}; known axes: "
                              f"{LOGICAL_AXES}")
    sizes = logical_axis_sizes(config)
    for name in LOGICAL_AXES:
        axes = tuple(rules[name]) if name in rules else ()
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(f"sharding.rules.{name} names mesh axis {axis!r}; mesh axes "
                                  f"are {MESH_AXES}")
        shards = math.prod(mesh_shape[a] for a in axes)
        if sizes[name] % shards:
            where = "x".join(f"mesh.{a}={mesh_shape[a]}" for a in axes)
            raise ConfigError(
                f"logical axis {name!r} has size {sizes[name]}, not divisible by {where} "
                f"(= {shards}) it is sharded over; change the mesh or the size, or set "
                f"sharding.rules.{name} to shard it over fewer axes")
    if layout == "data":  # ZeRO-1 must split every parameter's moments: checked on its shapes
        from jaxscale.parallel.sharding import rules_from_config
        from jaxscale.state import model_spec, moment_specs

        moment_specs(model_spec(config), rules_from_config(rules), mesh_shape, layout)
