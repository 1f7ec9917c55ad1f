"""Rotary position embeddings ("rotate half" layout, as Hugging Face Llama), with the Llama 3.1+
frequency scaling or linear scaling (Gemma 3 4B and larger), accurate at any position.

The naive float32 form, cos(position * frequency), loses the angle's low bits once the product
is in the thousands: at position 8000 one float32 ulp of the angle is ~5e-4 rad, so the rotation
drifts by ~1e-4 relative. Here the frequencies are computed in float64 on the host, and cos/sin of
position * frequency are built from three float64 tables indexed by the position's bytes
(position = a * 2^16 + b * 2^8 + c) with the angle-addition formulas: every table entry is exact
to float32 rounding, so the result is accurate to a few float32 ulps of 1 at every position
below 2^24, with no angle ever formed in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxscale.errors import ConfigError

_DIGIT_BITS = 8  # each table covers one byte of the position
_DIGITS = 3  # positions below 2^24 (float32 and every real context length are below that)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1+ frequency scaling (Hugging Face `rope_type: llama3`, `kind` "llama3"):
    wavelengths longer than original_max_seq_len / low_freq_factor are stretched by `factor`,
    those shorter than original_max_seq_len / high_freq_factor are kept, and those between are
    blended smoothly. `kind` "linear" (`rope_type: linear`): every wavelength stretched by
    `factor` (positions divided by it); the other fields unused."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int
    kind: str = "llama3"


def check_head_dim(head_dim: int) -> None:
    """ConfigError for a `model.head_dim` RoPE cannot rotate: it turns a head's dimensions in
    pairs (the first half with the second), so an odd one leaves a dimension without a partner."""
    if head_dim % 2:
        raise ConfigError(f"model.head_dim={head_dim} is odd; RoPE rotates a head's dimensions in "
                          f"pairs, so it must be even: use {head_dim - 1} or {head_dim + 1} "
                          "(most models use 64 or 128)")


def inv_frequencies(head_dim: int, theta: float,
                    scaling: RopeScaling | None = None) -> np.ndarray:
    """float64 [head_dim // 2] rotation frequencies (radians per position), as Hugging Face's
    `_compute_default_rope_parameters` / `_compute_llama3_parameters` /
    `_compute_linear_scaling_rope_parameters` define them."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(half, dtype=np.float64) * 2 / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    s = scaling
    wavelen = 2 * np.pi / inv_freq
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_seq_len / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


@functools.lru_cache(maxsize=16)
def _tables(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """float32 [digits, 256, 2, half]: cos and sin of (d * 256^k) * inv_freq for digit d of
    byte k, computed in float64 (angles reduced exactly enough there) and rounded once."""
    inv_freq = inv_frequencies(head_dim, theta, scaling)
    digit = np.arange(1 << _DIGIT_BITS, dtype=np.float64)
    angles = np.stack([(digit * float(1 << (_DIGIT_BITS * k)))[:, None] * inv_freq
                       for k in range(_DIGITS)])  # [digits, 256, half]
    return np.stack([np.cos(angles), np.sin(angles)], axis=2).astype(np.float32)


def rotation(positions: jax.Array, head_dim: int, theta: float,
             scaling: RopeScaling | None = None) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each float32 [*positions.shape, head_dim // 2], of positions * frequencies."""
    tables = jnp.asarray(_tables(head_dim, theta, scaling))
    positions = positions.astype(jnp.int32)
    cos = sin = None
    for k in range(_DIGITS):
        digit = (positions >> (_DIGIT_BITS * k)) & ((1 << _DIGIT_BITS) - 1)
        c, s = tables[k, digit, 0], tables[k, digit, 1]
        # cos(a + b) = cos a cos b - sin a sin b; sin(a + b) = sin a cos b + cos a sin b
        cos, sin = (c, s) if cos is None else (cos * c - sin * s, sin * c + cos * s)
    return cos, sin


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding ("rotate half" layout) on x: [batch, length, heads, head_dim]
    at integer `positions` [batch, length]."""
    cos, sin = rotation(positions, x.shape[-1], theta, scaling)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
