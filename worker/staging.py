"""Several host arrays onto the device through one pinned buffer and one copy.

Pinning a fresh host tensor per array costs a pinned-memory allocation and a copy launch each; a step's
inputs are half a dozen small arrays. `stage` lays them out, 16-byte aligned, in one pinned byte buffer from
torch's pinned-memory cache (which reuses a buffer only once its copy is done: the next step is prepared
while this one may still wait to run), copies it in one non-blocking transfer and hands back a typed view
of the device copy per array. On the CPU the arrays are wrapped as they are (no copy).
"""

from __future__ import annotations

import numpy as np
import torch

# Each array starts at a multiple of 16 bytes: Triton specializes kernels on whether a pointer is 16-byte
# aligned, and an offset that changed from step to step would compile new variants mid-run.
_ALIGN = 16


def stage(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Each array (any shape, a numeric dtype) as a tensor on `device`, in order."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    view = host.numpy()
    for a, off in zip(arrays, offsets, strict=True):
        view[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
    staged = host.to(device, non_blocking=True)
    out = []
    for a, off in zip(arrays, offsets, strict=True):
        dtype = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype  # numpy's dtype as torch's
        out.append(staged[off : off + a.nbytes].view(dtype).view(a.shape))
    return out
