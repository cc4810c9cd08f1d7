"""The one uniform number each sampled token is drawn with: a hash of the sequence's seed and the token's
position (worker/sampler.py), on the host, a scalar and an array form that agree bit for bit."""

from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1  # a seed's low 64 bits: what its draws depend on


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, position: int) -> float:
    """A number in [0, 1) that depends only on (seed, position), well mixed in both."""
    bits = _splitmix64(_splitmix64(seed & MASK64) ^ (position & MASK64))
    return (bits >> 11) / float(1 << 53)


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    # uint64 arithmetic wraps modulo 2**64 and `>>` shifts zeros in, which is exactly what `_splitmix64` does.
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms_for(seed: np.ndarray, position: np.ndarray) -> np.ndarray:
    """`uniform_for` over arrays, bit for bit, on the host: seed [N] uint64 (or int64 holding the same bits),
    position [N] non-negative integers; float64 [N]."""
    seed = np.asarray(seed)
    seed = seed.view(np.uint64) if seed.dtype == np.int64 else seed.astype(np.uint64, copy=False)
    bits = _splitmix64_array(_splitmix64_array(seed) ^ np.asarray(position).astype(np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)
