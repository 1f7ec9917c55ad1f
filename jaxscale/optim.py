"""The optimizer: AdamW with linear warmup and cosine decay, global-norm clipping, a decay mask."""

from __future__ import annotations

import jax
import ml_collections
import optax
from jax.sharding import PartitionSpec as P


def learning_rate_schedule(optim: ml_collections.ConfigDict, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `optim.lr`, then cosine decay to `lr * min_lr_ratio` at the end."""
    warmup = min(optim.warmup_steps, total_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=optim.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=optim.lr * optim.min_lr_ratio)


def decay_mask(logical_specs):
    """True for weight matrices, False for norm scales and biases.

    Decided from logical axes rather than ndim: scanned layers stack every parameter along a
    leading `layers` axis, so a per-layer norm scale is 2-D but still a vector per layer.
    """
    return jax.tree.map(lambda spec: sum(a != "layers" for a in spec) >= 2, logical_specs,
                        is_leaf=lambda x: isinstance(x, P))


def make_optimizer(optim: ml_collections.ConfigDict, total_steps: int,
                   logical_specs) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW chain for parameters whose logical axes are `logical_specs` (for the decay mask)."""
    schedule = learning_rate_schedule(optim, total_steps)
    parts = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=optim.b1, b2=optim.b2, eps=optim.eps,
                             weight_decay=optim.weight_decay, mask=decay_mask(logical_specs)))
    return optax.chain(*parts), schedule
