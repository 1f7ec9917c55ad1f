"""Config defaults and validation.

A config file is a Python file whose `get_config()` returns an `ml_collections.ConfigDict` built on
`default_config()` (loaded by `jaxscale.cli`). The schema is `default_config()` (every key, its
default) and `NUMBERS` (the kind of every numeric key: whole or real, its range, what 0 or -1
means); `check_schema` checks a config against both without importing anything, and `validate`
adds the checks that relate keys to each other and to the devices. Each raises `ConfigError` with
the key, the bad value and the fix, before anything is compiled or written.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections

from jaxscale.distributed import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_INIT_TIMEOUT_S
from jaxscale.errors import ConfigError
from jaxscale.kinds import Number, real, whole

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
    **{f"mesh.{axis}": _MESH_SIZE for axis in MESH_AXES},
    **{f"mesh.dcn.{axis}": _SIZE for axis in MESH_AXES},
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
    "model.loss_chunk_len": whole("[0, inf)", {0: "the whole sequence at once"}),
    "model.moe.experts": whole("[0, inf)"),
    "model.moe.top_k": _SIZE,
    "model.moe.capacity_factor": real("(0, inf)"),
    "model.moe.every": whole("[0, inf)", {0: "no MoE layers"}),
    "model.moe.aux_loss_weight": real("[0, inf)", _OFF),
    "model.moe.z_loss_weight": real("[0, inf)", _OFF),
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
}


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
    if math.prod(dcn.values()) != num_slices:
        raise ConfigError(
            f"mesh.dcn sizes {dcn} multiply to {math.prod(dcn.values())} but there are "
            f"{num_slices} slices/hosts; make their product {num_slices}")
    per_slice = num_devices // num_slices
    ici = {a: int(mesh[a]) for a in MESH_AXES}
    free = [a for a, v in ici.items() if v == -1]
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


def validate(config: ml_collections.ConfigDict, num_devices: int, num_slices: int = 1
             ) -> tuple[dict[str, int], dict[str, int]]:
    """Raises ConfigError on the first problem in `config` for a run on `num_devices` devices in
    `num_slices` DCN-connected granules; returns the mesh's (ici, dcn) axis sizes."""
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
    if config.precision.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"precision.compute_dtype={config.precision.compute_dtype!r} is "
                          f"unknown; use one of {COMPUTE_DTYPES}")
    _check_data(config)
    _check_performance(config)
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
    if e.every == 0:
        return
    if e.experts < 2:
        raise ConfigError(f"model.moe.experts={e.experts} must be >= 2 when model.moe.every="
                          f"{e.every} makes layers MoE; set the expert count (8 for Mixtral)")
    if e.top_k > e.experts:
        raise ConfigError(f"model.moe.top_k={e.top_k} must be between 1 and model.moe.experts="
                          f"{e.experts} (the experts each token is routed to)")
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


def _check_data(config: ml_collections.ConfigDict) -> None:
    # Imported here: the data package pulls in grain, which config loading does not need.
    from jaxscale.data.packing import METHODS
    from jaxscale.data.sources import source_specs
    from jaxscale.data.tokenizers import tokenizer_from_config

    d, m = config.data, config.model
    source_specs(config)
    if d.packing not in METHODS:
        raise ConfigError(f"data.packing={d.packing!r} is unknown; use one of {METHODS}")
    vocab = tokenizer_from_config(config).vocab_size
    if vocab > m.vocab_size:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's "
                          f"{vocab} ids; set model.vocab_size >= {vocab}")


def _check_performance(config: ml_collections.ConfigDict) -> None:
    """The profile window, the XLA flags setting and the optimizer's memory options."""
    from jaxscale.optim import check_memory_options
    from jaxscale.profiling import check_window
    from jaxscale.xla_flags import check_setting

    check_window(config.profile, config.train.steps)
    check_setting(config.performance.xla_flags)
    check_memory_options(config.optim)


def _check_checkpoint(config: ml_collections.ConfigDict) -> None:
    c = config.checkpoint
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
