"""The PyTorch peer: Hugging Face's `LlamaForCausalLM`, trained the way a user of a compiled
PyTorch loop would, with a jaxscale config's shapes and settings, timed the way the trainer's
log window is timed.

    python benchmarks/peer_torch.py --config=configs/llama_1b.py --config.train.batch_size=4 \
        --config.train.steps=30 --config.train.log_every=10 [--device=cuda] [--compile=1]

What it takes from the config: the model's shapes (jaxscale's `model_config`, written as a
transformers config by `jaxscale.hf.config.hf_config`: tied embeddings, Llama 3.x RoPE), the
batch and sequence length, the optimizer (AdamW with jaxscale's betas, eps and weight decay, the
decay off for norm scales as jaxscale's `decay_mask` has it, global-norm clipping, and the rate of
every step from jaxscale's own schedule) and `model.remat`: `none` keeps every activation,
`full` is Hugging Face's gradient checkpointing of each layer, `save_dots` the same with
PyTorch's selective checkpointing saving the matmuls' outputs (torchtitan's "selective op"
policy), what jaxscale's `save_dots` keeps. Float32 master weights under bfloat16 autocast (the
logits and loss in float32), fused AdamW, SDPA attention, random tokens drawn on the device.
`--compile=1` (the default) compiles the whole step function with `torch.compile`.

Timing: steps run in windows of `train.log_every`; a window's wall time is taken after the
device has finished its last step, as the trainer's is, and the last window is reported (the
first includes compilation). Prints, last, `tokens_per_sec: X`; `benchmarks/accelerator.sh
--peer` runs it beside jaxscale with the same flags and prints their ratio.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time

# JAX computes the learning rates here, on the host: it must not take the GPU the peer trains on
# (JAX's allocator reserves 75% of it when it starts there).
os.environ["JAX_PLATFORMS"] = "cpu"

import numpy as np
import torch
import transformers
from torch.utils import checkpoint as torch_checkpoint

from jaxscale.cli import Option, parse_config_flags
from jaxscale.hf.config import hf_config
from jaxscale.kinds import whole
from jaxscale.models.spec import model_config
from jaxscale.runtime.chips import GIB, peak_flops_per_device
from jaxscale.training.optim import learning_rate_schedule

OPTIONS = [
    Option("device", "cuda", "where the peer trains: cuda or cpu", "DEVICE"),
    Option("compile", 1, "1: torch.compile the whole step; 0: eager", "0|1",
           kind=whole("[0, 1]")),
]
# The matmuls whose outputs selective checkpointing keeps under remat `save_dots`.
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.addmm.default, torch.ops.aten.linear.default}


def _save_matmuls(ctx, op, *args, **kwargs):
    policy = torch_checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op in _MATMULS else policy.PREFER_RECOMPUTE


def build_model(config, device: str) -> transformers.LlamaForCausalLM:
    """The Hugging Face Llama with the config's shapes, float32 weights, SDPA attention and the
    remat policy mapped to activation checkpointing."""
    cfg = model_config(config)
    # jaxscale's embedding and head have the padded vocabulary's rows (`model.vocab_multiple`):
    # the peer gets as many, so both do the same matmuls.
    hf = transformers.LlamaConfig(**{**hf_config(cfg, "float32"),
                                     "vocab_size": cfg.padded_vocab_size})
    model = transformers.LlamaForCausalLM._from_config(hf, attn_implementation="sdpa",
                                                       torch_dtype=torch.float32).to(device)
    remat = config.model.remat
    if remat != "none":
        kwargs = dict(use_reentrant=False)
        if remat == "save_dots":
            kwargs["context_fn"] = functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts, _save_matmuls)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def build_optimizer(config, model, device: str):
    """(fused AdamW as jaxscale's, the rate of every step from jaxscale's schedule). The rate is
    a tensor, so a compiled step reads it without recompiling."""
    o = config.optim
    decayed = [p for p in model.parameters() if p.ndim >= 2]
    plain = [p for p in model.parameters() if p.ndim < 2]  # norm scales
    lr = torch.tensor(0.0, device=device)
    optimizer = torch.optim.AdamW(
        [dict(params=decayed, weight_decay=o.weight_decay), dict(params=plain, weight_decay=0.0)],
        lr=lr, betas=(o.b1, o.b2), eps=o.eps, fused=True)
    rates = np.asarray(learning_rate_schedule(o, config.train.steps)(
        np.arange(config.train.steps)), np.float32)
    return optimizer, rates


def make_step(config, model, optimizer, device: str, compiled: bool):
    """step(tokens [batch, seq + 1]) -> the mean loss: forward under autocast, float32 loss,
    backward, clipping, the update."""
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16)
                if config.precision.compute_dtype == "bfloat16" else contextlib.nullcontext())
    clip = config.optim.grad_clip

    def step(tokens):
        with autocast:
            logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return torch.compile(step) if compiled else step


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(config, device: str, compiled: bool) -> dict:
    """Trains `train.steps` steps; the last window's figures."""
    t = config.train
    torch.manual_seed(t.seed)
    model = build_model(config, device)
    optimizer, rates = build_optimizer(config, model, device)
    step = make_step(config, model, optimizer, device, compiled)
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = model_config(config).flops_per_token(num_params, t.seq_len)
    started = window_start = time.perf_counter()
    window = {}
    for i in range(t.steps):
        for group in optimizer.param_groups:
            group["lr"].fill_(float(rates[i]))
        tokens = torch.randint(0, config.model.vocab_size, (t.batch_size, t.seq_len + 1),
                               device=device)
        loss = step(tokens)
        if i == 0:  # the first step alone, compilation included, as the trainer reports it
            float(loss)
            synchronize(device)
            first_step = time.perf_counter() - started
        if (i + 1) % t.log_every == 0:
            loss = float(loss)  # waits for the window's last step, as the trainer's log does
            synchronize(device)
            now = time.perf_counter()
            seconds = (now - window_start) / t.log_every
            window = dict(step=i + 1, loss=loss, step_time=seconds,
                          tokens_per_sec=t.batch_size * t.seq_len / seconds)
            print(json.dumps(window), flush=True)
            window_start = now
    kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_flops_per_device(kind)
    window.update(device=kind, params=num_params, time_to_first_step=first_step,
                  mfu=window["tokens_per_sec"] * flops_per_token / peak if peak else None,
                  memory_peak_gib=(torch.cuda.max_memory_allocated() / GIB
                                   if device == "cuda" else None))
    return window


def main(argv: list[str]) -> None:
    config, options = parse_config_flags(argv, prog="python benchmarks/peer_torch.py",
                                         about=__doc__, options=OPTIONS)
    result = train(config, options["device"], bool(options["compile"]))
    print(f"peer: {json.dumps(result)}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{'compiled' if options['compile'] else 'eager'}, remat {config.model.remat}")
    print(f"tokens_per_sec: {result['tokens_per_sec']:.1f}")


if __name__ == "__main__":
    main(sys.argv)
