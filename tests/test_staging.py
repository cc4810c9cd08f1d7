"""One pinned buffer for a step's host arrays (worker/staging.py): every array arrives whole, typed and
shaped, at a 16-byte aligned address (skipped parts without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.worker.staging import stage


def _arrays(rng: np.random.Generator) -> list[np.ndarray]:
    return [
        rng.integers(-(1 << 40), 1 << 40, size=7, dtype=np.int64),
        rng.integers(0, 1 << 30, size=(3, 5), dtype=np.int32),  # an odd byte count before the next
        np.zeros(0, dtype=np.int64),  # empty: no rows to pick
        rng.integers(0, 9, size=1, dtype=np.int32),
        rng.standard_normal(4).astype(np.float32),
        np.arange(11, dtype=np.int64)[::2],  # not contiguous
    ]


def test_on_the_cpu_the_arrays_are_wrapped_as_they_are() -> None:
    arrays = _arrays(np.random.default_rng(0))
    out = stage(arrays, torch.device("cpu"))
    for a, t in zip(arrays, out, strict=True):
        assert t.shape == a.shape and np.array_equal(t.numpy(), a)
    assert out[0].data_ptr() == arrays[0].ctypes.data  # no copy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_one_copy_brings_every_array_typed_and_aligned() -> None:
    rng = np.random.default_rng(1)
    for _ in range(20):
        arrays = _arrays(rng)
        out = stage(arrays, torch.device("cuda"))
        for a, t in zip(arrays, out, strict=True):
            assert t.is_cuda and t.shape == a.shape and t.dtype == torch.from_numpy(a.copy()).dtype
            assert t.data_ptr() % 16 == 0
            assert np.array_equal(t.cpu().numpy(), a)
        arrays[0][:] = 0  # the host arrays are free to change once staged
        torch.cuda.synchronize()
        assert out[0].abs().sum().item() > 0
