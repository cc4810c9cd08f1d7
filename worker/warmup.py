"""The sampler's Triton kernels compiled at start, on CUDA, rather than by the first request that needs them.

Triton compiles a kernel on its first launch for each specialization (dtypes, constexprs, which integer
arguments are 1 or multiples of 16). The sampler's kernels (the top-p draw, the penalties, min_p, the
grammar bitmask) otherwise compiled inside the first step that used them: a few hundred milliseconds each of
a stalled GPU for that step's every request (measured as 1.2 s more GPU time over the 1B workload with
penalties on every request). Each is launched here once on a few rows of the model's own logits width and
dtype, which are what its launches will see.
"""

from __future__ import annotations

import torch

from pagedserve.common.messages import SamplingParams
from pagedserve.worker.sampler import SamplingRow, sample

NUM_ROWS = 4  # more than one: Triton specializes an integer argument that is 1


@torch.inference_mode()
def warm_up_sampling_kernels(model: torch.nn.Module, hidden_size: int, device: torch.device) -> None:
    """Launches each sampling kernel once on NUM_ROWS rows of logits from `model`'s own LM head."""
    if device.type != "cuda":
        return
    from pagedserve.kernels.processors import min_p_, penalize_
    from pagedserve.kernels.token_bitmask import apply_token_bitmask

    hidden = torch.zeros(NUM_ROWS, hidden_size, dtype=model.dtype, device=device)
    logits = model.compute_logits(hidden).contiguous()  # [R, V], the width and dtype the sampler sees
    rows = torch.arange(NUM_ROWS, device=device)
    sample(logits.clone(), [SamplingRow(SamplingParams(top_p=0.9), b, 0) for b in range(NUM_ROWS)])
    out = logits.float()  # the processors work on a float32 copy (worker/logits_processors.py)
    vocab = out.shape[-1]
    counts = torch.zeros(NUM_ROWS, vocab, dtype=torch.int32, device=device)
    in_prompt = torch.zeros(NUM_ROWS, vocab, dtype=torch.bool, device=device)
    ones = torch.ones(NUM_ROWS, dtype=torch.float32, device=device)
    penalize_(out, rows, rows, counts, in_prompt, ones * 0.5, ones * 0.5, ones * 1.1)
    min_p_(out, rows, torch.log(ones * 0.05))
    words = -(-vocab // 32)
    mask = torch.full((NUM_ROWS, words), -1, dtype=torch.int32, device=device)
    apply_token_bitmask(logits, mask, rows, torch.zeros(NUM_ROWS, dtype=torch.int32, device=device), mask[:1])
    torch.cuda.synchronize(device)
