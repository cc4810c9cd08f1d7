"""How much memory one step can take: the KV pool gets what --gpu-memory-utilization leaves after it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.batch_limits import profile_max_num_seqs
from pagedserve.worker.inputs import build_inputs
from pagedserve.worker.kv_cache import KVPools
from pagedserve.worker.sampler import SamplingRow, sample
from pagedserve.worker.sequences import BlockTableArray


@torch.inference_mode()
def profile_peak_memory(runner: Any, cfg: WorkerConfig) -> int:  # a ModelRunner, before its KV pool exists
    """Peak bytes of torch's allocator over the weights and one eager forward of the largest step the
    budgets allow (max_num_batched_tokens tokens over max_num_seqs prompts, every prompt sampling), with a
    KV pool just large enough for it, whose own size is left out."""
    max_num_seqs = profile_max_num_seqs(cfg.max_num_seqs)  # with 0 (the pool's), the most it may be
    num_tokens = max(1, min(cfg.max_num_batched_tokens, runner.max_model_len * max_num_seqs))
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
    lens[: num_tokens % num_seqs] += 1
    blocks_per_seq = -(-int(lens.max()) // runner.block_size)
    pool = KVPools(
        runner.shard_config, num_seqs * blocks_per_seq, 0, runner.block_size, runner.kv_dtype, runner.device
    )
    tables = BlockTableArray(blocks_per_seq, initial_rows=num_seqs)
    for b in range(num_seqs):
        tables.add(list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)))
    inputs = build_inputs(
        tables,
        np.arange(num_seqs),
        np.zeros(num_seqs, dtype=np.int64),
        lens,
        np.zeros(num_tokens, dtype=np.int64),
        runner.block_size,
    )
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    token_ids, positions, meta = runner._to_device(inputs)
    hidden = runner.model(token_ids, positions, meta, pool.layers)
    logits = runner.model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])
    # top-k's candidate keys ([rows, vocab] int64) are the costliest path now that top-p draws without a sort
    rows = [SamplingRow(SamplingParams(top_k=4096, logprobs=5), b, 0) for b in range(num_seqs)]
    sample(logits, rows)
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device)
    pool_bytes = pool.device_pool.numel() * pool.device_pool.element_size()
    # Beside the sampler's peak, the logits processors (worker/logits_processors.py) make a float32 copy of
    # the logits and keep a TokenHistory slot per penalized sequence (int32 counts and a bool prompt mask
    # over the vocabulary), in slots that double from 8: counted here at their largest.
    vocab = logits.shape[-1]
    history_slots = 1 << max(3, (num_seqs - 1).bit_length())
    processors_bytes = num_seqs * vocab * 4 + history_slots * vocab * (4 + 1)
    del pool, hidden, logits
    torch.cuda.empty_cache()
    return peak - pool_bytes + processors_bytes
