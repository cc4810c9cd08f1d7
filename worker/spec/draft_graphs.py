"""The draft model's steady-state `propose` as one CUDA graph replay (issue 24).

In the steady state every drafting row lacks exactly one token (the target's own after the drafts it
accepted: the draft wrote every draft's KV at its last call) and draws k drafts. The step-by-step path
(worker/spec/draft_model.py `_first_forward`, `_decode`) then runs 1 + k decode steps, each with its own
`build_inputs`, staging transfer and graph replay, and at low load that host work, not the draft's GPU time,
is what the target's verification waits for. A `DraftChain` records the 1 + k steps in one graph per padded
batch size:

    step 0        each row's last token, at position length - 1       -> argmax: draft 0
    step j < k    draft j - 1, at position length + j - 1             -> argmax: draft j
    step k        draft k - 1, at position length + k - 1             (its KV only: no LM head)

Each step's positions, slots and context lengths are computed on the device from each row's length, draft
count and block table (`chain_inputs`), so the host writes a call's inputs once, in one staging transfer:
the rows' last tokens, lengths, draft counts and rows of the call, and their block tables. The drafts [B, k]
stay on the device; the KV the chain writes is exactly what the steps would write. A row with d < k drafts
(near its max_tokens or max_model_len, where the scheduler gives fewer) writes the KV of steps 0 .. d only,
as the step-by-step path, whose shrinking batches leave it out after its step d: past it the row stays at
its last position with slot -1 (no write, no position its blocks or RoPE lack), and its columns past d are
never read (`DeviceDrafts` counts).

The chain runs over the draft's `DecodeGraphs` (worker/cuda_graphs.py): their static buffers (token ids,
positions, slots, lengths, block tables), their forward (so the split-KV choice of the attention is theirs)
and their memory pool. A batch of B rows replays the chain of the smallest captured size that holds it; its
padding rows have length 0, which makes them what `DecodeGraphs` pads with: position 0, slot -1 (the KV write
skips it), a context of one token of whatever blocks their table row last held. They compute a row nobody
reads and write nothing.

Chains are captured for k = num_speculative_tokens only, and a call is chained when its rows' most drafts
is k: the scheduler's policy gives rows k drafts while the running sequences are at most the draft budget /
k (16 at the defaults), and past that the draft's host cost is spread over many rows (and a chain of k steps
would compute steps nobody asked for). A call with a row still catching up, with fewer than k drafts for
every row, or with more rows than the largest graph takes the step-by-step path. A size's chain records
1 + k forwards and k LM heads (argmax included): its capture takes about 1 + k times a decode graph's, and
its memory is that of its largest intermediate ([size, V] logits) in the shared pool, plus its [size, k]
drafts; `capture_time_s` and `capture_bytes` say what they were.

`capture=False` runs the same chain eagerly on any device: what the CPU tests hold to the step-by-step path.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from pagedserve.worker.cuda_graphs import DecodeGraphs
from pagedserve.worker.staging import stage


def chain_inputs(
    lengths: torch.Tensor,  # [S] int64: each row's token count (the first draft's position); 0: padding
    num_drafts: torch.Tensor,  # [S] int64: each row's drafts d, 1 .. k (0: padding)
    block_tables: torch.Tensor,  # [S, W] int32: each row's blocks, enough for its last draft's slot
    steps: torch.Tensor,  # [N, 1] int64: the chain's steps 0 .. k (arange)
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every step's decode inputs: positions [N, S] int64, slots [N, S] int64 and context lengths [N, S]
    int32. At step j <= d row b computes the token at position lengths[b] - 1 + j, in slot block *
    block_size + offset of its table; past its d it stays at its last position and writes nothing (slot -1);
    a padding row is at position 0 with slot -1 and one token of context. No host sync: a graph records it."""
    valid = lengths > 0  # [S]
    positions = torch.where(valid, lengths - 1 + torch.minimum(steps, num_drafts), 0)  # [N, S]
    blocks = block_tables.gather(1, (positions // block_size).T).T.to(torch.int64)  # [N, S]
    writes = valid & (steps <= num_drafts)  # [N, S]
    slots = torch.where(writes, blocks * block_size + positions % block_size, -1)
    return positions, slots, (positions + 1).to(torch.int32)


class DraftChain:
    """The draft's 1 + k decode steps of a steady-state call as one graph per padded batch size (module
    doc), over the buffers, forward and memory pool of its `DecodeGraphs`."""

    def __init__(
        self,
        graphs: DecodeGraphs,
        block_size: int,
        num_drafts: int,  # k: the most drafts a row of a chained call draws
        capture: bool = True,
    ) -> None:
        self.graphs = graphs
        self.model = graphs.model
        self.block_size = block_size
        self.num_drafts = num_drafts
        device = graphs.token_ids.device
        self.device = device
        n = graphs.sizes[-1]
        # A call's inputs: each row's last token, its length and its drafts (0, 0, 0 for a padding row).
        self.inputs = torch.zeros(3, n, dtype=torch.int64, device=device)  # [3, N]
        self._steps = torch.arange(num_drafts + 1, device=device).unsqueeze(1)  # [k + 1, 1] int64
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._drafts: dict[int, torch.Tensor] = {}  # each graph's output: [size, k] int64
        self.captured = capture
        self.capture_time_s = 0.0
        self.capture_bytes = 0  # device memory the captures took (the shared pool's growth, the graphs)
        self.num_replays = 0  # chained calls (replays, or eager runs when not captured)
        if capture:
            self._capture()

    def padded_size(self, batch: int) -> int | None:
        """The chain that runs `batch` rows, or None when there are more than the largest holds."""
        return self.graphs.padded_size(batch) if batch > 0 else None

    def _chain(self, size: int) -> torch.Tensor:  # [size, k] int64
        """The chain over the first `size` rows of the static inputs: what a graph records."""
        g = self.graphs
        lengths, num_drafts = self.inputs[1, :size], self.inputs[2, :size]
        positions, slots, seq_lens = chain_inputs(
            lengths, num_drafts, g.block_tables[:size], self._steps, self.block_size
        )
        drafts = torch.empty(self.num_drafts, size, dtype=torch.int64, device=self.device)  # [k, size]
        g.token_ids[:size].copy_(self.inputs[0, :size])
        for j in range(self.num_drafts + 1):
            g.positions[:size].copy_(positions[j])
            g.slot_mapping[:size].copy_(slots[j])
            g.seq_lens[:size].copy_(seq_lens[j])
            hidden = g.forward(size)  # [size, H]
            if j < self.num_drafts:  # the last step is for the last draft's KV
                torch.argmax(self.model.compute_logits(hidden), dim=-1, out=drafts[j])
                g.token_ids[:size].copy_(drafts[j])
        return drafts.T

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.monotonic()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        # Largest first, as the decode graphs: the smaller reuse its memory. The inputs are all padding (0s),
        # so the warm-ups write no KV (and a capture runs nothing).
        for size in reversed(self.graphs.sizes):
            self._chain(size)  # warm-up: compiles, allocates the kernels' buffers outside the graph
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graphs.pool):
                self._drafts[size] = self._chain(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_time_s = time.monotonic() - started
        self.capture_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]

    def run(
        self,
        token_ids: np.ndarray,  # [B] int64: each row's last token (the one it lacks)
        lengths: np.ndarray,  # [B] int64: each row's token count, that token included
        num_drafts: np.ndarray,  # [B] int64: each row's drafts, 1 .. k
        block_tables: np.ndarray,  # [B, W] int32: the rows' blocks, through the last draft's slot
        index: np.ndarray,  # [B] int64: each row's row of the call
        num_rows: int,  # the call's rows
    ) -> torch.Tensor:  # [num_rows, k] int64 on the device: row index[b]'s drafts first; 0s for the others
        """One chained call: its inputs in one transfer, the chain's replay, the drafts in call order."""
        batch = len(lengths)
        size = self.padded_size(batch)
        assert size is not None and lengths.min() > 0
        assert num_drafts.min() > 0 and num_drafts.max() <= self.num_drafts
        host = np.zeros((4, size), dtype=np.int64)  # padding rows: token 0, length 0, no drafts
        host[0, :batch] = token_ids
        host[1, :batch] = lengths
        host[2, :batch] = num_drafts
        host[3, :batch] = index
        staged, tables = stage([host, block_tables], self.device)
        self.inputs[:, :size].copy_(staged[:3])
        # Only the columns the rows use (`chain_inputs` and the attention read no further).
        self.graphs.block_tables[:batch, : block_tables.shape[1]].copy_(tables)
        if self.captured:
            self._graphs[size].replay()
            drafts = self._drafts[size]
        else:
            drafts = self._chain(size)
        self.num_replays += 1
        # Copied out at once into a fresh table: the graph's output is rewritten by the next call (maybe
        # before the target has read these drafts) and may lie in memory that the decode graphs sharing its
        # pool use as scratch.
        table = torch.zeros((num_rows, self.num_drafts), dtype=torch.int64, device=self.device)
        table[staged[3, :batch]] = drafts[:batch]
        return table
