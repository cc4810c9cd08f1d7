"""Verification as a decode batch: a step whose sequences each compute 1 + d tokens (d drafts; plain
decodes d = 0) laid out as one decode row per token, so that the target's verification replays a decode CUDA
graph (worker/cuda_graphs.py `DecodeGraphs`) instead of the piecewise graphs with eager attention.

Row r of the expanded batch is one token: its own position and slot (as in the mixed layout), its
sequence's block table (repeated) and a context of position + 1 tokens. Every attention backend (and every
graph, which records the same forward) writes all the step's K/V through the slot mapping before the layer's
attention reads the cache (worker/attention.py), so the row of draft j sees the sequence's cache up to its
own position, drafts 0 .. j - 1 included: exactly the causal attention of the 1 + d query tokens in one
chunk. The flat token order is unchanged, so the logits rows the verifier keeps (`SpecBatch.logits_rows`),
the pending tokens' feed indices and the slot of every token stay what the mixed layout gives.

What holds per row as it holds per chunk: a sliding layer's row sees keys position - window + 1 .. position,
inside the first row's window, whose blocks the sequence still holds (released blocks are read by no row);
FP8 caches are read back quantized either way (the chunk's own keys come from the cache in both layouts);
every tensor-parallel rank expands the same plan to the same rows.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pagedserve.worker.cuda_graphs import DecodeGraphs
from pagedserve.worker.inputs import HostInputs


def as_decode_rows(inputs: HostInputs) -> HostInputs:
    """The same tokens as one decode row each (module doc); `inputs` as `host_inputs` builds them."""
    num_tokens = np.diff(inputs.query_start_loc).astype(np.int64)  # [B]
    total = len(inputs.token_ids)
    return replace(
        inputs,
        block_tables=np.repeat(inputs.block_tables, num_tokens, axis=0),  # [T, max_blocks]
        seq_lens=(inputs.positions + 1).astype(np.int32),  # [T]: each row's context ends at itself
        query_start_loc=np.arange(total + 1, dtype=np.int32),
        max_query_len=1,
        num_decode_seqs=total,
    )


def verification_inputs(
    inputs: HostInputs,
    num_scheduled_tokens: list[int],  # [B] the plan's: 1 for every sequence when all decode
    num_tokens: list[int],  # [B] what each computes: 1 + its drafts
    scoring: bool,  # the step scores prompt tokens (prompt logprobs read the mixed layout's rows)
    graphs: DecodeGraphs | None,
) -> HostInputs:
    """The inputs the target's verification runs on: decode rows when every scheduled sequence decodes
    (one token of the plan, plus its drafts), some sequence drafts, no prompt is scored, and the rows fit a
    captured decode graph, or there are no graphs (the eager decode path, which the CPU tests run); else
    `inputs` as they are (the mixed path)."""
    total = len(inputs.token_ids)
    if scoring or max(num_scheduled_tokens) != 1 or total == len(num_tokens):
        return inputs
    if graphs is not None and graphs.padded_size(total) is None:
        return inputs  # more rows than the largest graph: one query of 1 + d per sequence reads less
    return as_decode_rows(inputs)
