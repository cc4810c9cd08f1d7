"""The sampler's top-p draws (top-p without top-k, or top_k above the sampler's candidate widths) on a GPU:
rejection rounds in one Triton launch instead of a stable sort of [rows, vocab] (kernels/nucleus.py, which
proves that the draws follow the truncated, renormalized softmax exactly). On the CPU the sampler keeps its
sort (`sample_tensors`), whose draws the tests pin token by token.

A row's draw depends only on its logits, parameters, seed and position, as every draw of the sampler: round
r's uniform is `uniforms_for(seed, position + r * 2**48)` (round 0's is the plain draw's own), computed on
the host with the others and copied with them. So every top-p row on a GPU takes the kernel, whatever the
batch: a threshold on the number of rows (the sort for a few) would make a row's draw depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

NUCLEUS_ROUNDS = 8  # rejection rounds before the kernel's exact fallback; a row needs about 1.1 at top_p 0.9
_ROUND_STRIDE = 1 << 48  # positions stay far below it, so (position + r * stride) never meets another's


def round_uniforms_for(
    uniforms_for: Callable[[np.ndarray, np.ndarray], np.ndarray],  # worker.sampler.uniforms_for
    seed: np.ndarray,  # [N] uint64, or int64 holding the same bits
    position: np.ndarray,  # [N] non-negative
    rounds: int = NUCLEUS_ROUNDS,
) -> np.ndarray:  # [N, rounds + 1] float64
    """Each row's uniform per rejection round; column `rounds` is the fallback's."""
    position = np.asarray(position).astype(np.uint64)
    offsets = np.arange(rounds + 1, dtype=np.uint64) * np.uint64(_ROUND_STRIDE)
    seeds = np.repeat(np.asarray(seed), rounds + 1)  # one hashing pass over [N * (rounds + 1)]
    return uniforms_for(seeds, (position[:, None] + offsets[None, :]).reshape(-1)).reshape(-1, rounds + 1)


def device_round_uniforms(
    uniforms_for: Callable[[np.ndarray, np.ndarray], np.ndarray],
    groups: Sequence,  # the step's DrawGroups
    seed: np.ndarray,  # [R] by row
    position: np.ndarray,  # [R] by row
    order: np.ndarray,  # [R] logits row of each slot
    device: torch.device,
) -> torch.Tensor | None:  # [R, rounds + 1] float64 by slot; None off CUDA or without a top-p group
    """The round uniforms the GPU's top-p draws need, by slot, copied without waiting."""
    if device.type != "cuda" or not any(g.kind == "sorted" for g in groups):
        return None
    host = torch.from_numpy(
        round_uniforms_for(uniforms_for, np.asarray(seed)[order], np.asarray(position)[order])
    )
    return host.pin_memory().to(device, non_blocking=True)


def draw_nucleus_into(
    tokens: torch.Tensor,  # [R] int64, the step's tokens so far
    logits: torch.Tensor,  # [R, V] processed logits (before temperature)
    rows: torch.Tensor,  # [n] int64 the group's logits rows
    tensors,  # noqa: ANN001 - worker.sampler.SamplingTensors (imported there, so not here)
    slots: slice,  # the group's slots
    whole: bool,  # the group is every row, in order
) -> torch.Tensor:
    """The group's draws written into `tokens` (returned: a new tensor when the group is the whole batch)."""
    from pagedserve.kernels.nucleus import draw_nucleus

    drawn = draw_nucleus(
        logits,
        rows,
        tensors.temperature[slots],
        tensors.top_k[slots],
        tensors.top_p[slots],
        tensors.round_uniforms[slots],
    )
    if whole:
        return drawn
    return tokens.index_copy_(0, rows, drawn)
