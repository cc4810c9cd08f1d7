"""CUDA graphs for decode-only steps: one graph per padded batch size, every input in a static buffer.

A decode step launches a few hundred small kernels (per layer: norms, projections, RoPE, the KV write,
attention, the MLP); replaying a graph launches them with one call, so the host's launch cost disappears
from the step. Each graph is captured for a fixed batch size (1, 2, 4, 8, then every multiple of 8 up to
max_num_seqs); a step of B sequences replays the smallest graph that holds B, with the padding rows made
harmless: their slot is -1 (the KV write skips it) and their context one token of block 0, so they compute
a finite row that nobody reads.

The attention kernel's split-KV choice is part of the graph: it is made at capture for the longest context
the worker allows (max_model_len), and a split that finds no tiles of a shorter context does no work.
Prefills and mixed steps replay `MixedGraphs` (below): graphs of everything but the attention, per padded
token count (`--no-piecewise-graphs` runs them eagerly).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from pagedserve.worker.attention import AttentionMetadata
from pagedserve.worker.inputs import HostInputs
from pagedserve.worker.models.interface import CausalLM, KVCache
from pagedserve.worker.staging import stage


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (which is always one)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def _progress(done: int, total: int, started: float, what: str = "CUDA graphs") -> None:
    width = 30
    filled = width * done // total
    bar = "#" * filled + "." * (width - filled)
    end = "\n" if done == total else "\r"
    elapsed = time.monotonic() - started
    print(f"capturing {what} [{bar}] {done}/{total} {elapsed:.1f}s", end=end, file=sys.stderr, flush=True)


class DecodeGraphs:
    """Captured decode graphs of one model and KV pool, and the static buffers they read."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[KVCache],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        show_progress: bool = True,
        capture: bool = True,  # False: the buffers and `_forward` only, run eagerly (the CPU's tests)
    ) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        i32 = {"dtype": torch.int32, "device": device}
        i64 = {"dtype": torch.int64, "device": device}
        self.token_ids = torch.zeros(n, **i64)  # [N]
        self.positions = torch.zeros(n, **i64)  # [N]
        self.slot_mapping = torch.full((n,), -1, **i64)  # [N]
        self.seq_lens = torch.ones(n, **i32)  # [N]
        self.query_start_loc = torch.arange(n + 1, **i32)  # [N + 1], fixed: one token per sequence
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)  # [N, max_blocks_per_seq]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Each graph's output: the final hidden states, [size, H]. The LM head runs eagerly on the batch's
        # rows after the replay: a graph's outputs stay allocated for its lifetime, and [size, V] logits
        # held by a hundred graphs took gigabytes (a decode batch of 1,024 at TP=2 ran out of memory).
        self._hidden: dict[int, torch.Tensor] = {}
        self.capture_time_s = 0.0
        self.num_replays = 0
        # Their memory pool, which more graphs over these buffers can share (worker/spec/draft_graphs.py)
        self.pool: torch.cuda._POOL_HANDLE | None = None
        if capture:
            self._capture(show_progress)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decode_seqs=size,
        )

    def _forward(self, size: int) -> torch.Tensor:  # [size, H]
        return self.model(self.token_ids[:size], self.positions[:size], self._meta(size), self.kv_layers)

    def forward(self, size: int) -> torch.Tensor:  # [size, H]
        """The model's forward over the first `size` rows of the static buffers, as each graph records it:
        for graphs that chain several steps over these buffers (worker/spec/draft_graphs.py)."""
        return self._forward(size)

    @torch.inference_mode()
    def _capture(self, show_progress: bool) -> None:
        started = time.monotonic()
        pool = self.pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs reuse the memory of the larger ones from the shared pool.
        for i, size in enumerate(reversed(self.sizes)):
            self._forward(size)  # warm-up: compiles kernels and allocates their buffers outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._hidden[size] = self._forward(size)
            self._graphs[size] = graph
            if show_progress:
                _progress(i + 1, len(self.sizes), started)
        torch.cuda.synchronize()
        self.capture_time_s = time.monotonic() - started

    def padded_size(self, batch: int) -> int | None:
        """The graph that runs a decode batch of `batch` sequences, or None when it is too large."""
        if batch > self.sizes[-1]:
            return None
        lo, hi = 0, len(self.sizes) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.sizes[mid] >= batch:
                hi = mid
            else:
                lo = mid + 1
        return self.sizes[lo]

    def run(
        self,
        inputs: HostInputs,
        feed: tuple[torch.Tensor, torch.Tensor] | None = None,
        rows: torch.Tensor | None = None,  # [R] on the device: the batch rows whose logits to return
    ) -> torch.Tensor:  # [B, V] logits of the batch's B sequences ([R, V] with `rows`)
        """Copies a decode batch into the static buffers (and `feed`'s tokens, already on the device, to
        their indices) and replays its graph."""
        hidden = self.replay(inputs, feed)
        return self.model.compute_logits(hidden if rows is None else hidden[rows])

    def replay(
        self, inputs: HostInputs, feed: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:  # [B, H] the final hidden states: the KV written, no LM head
        """`run` without the LM head: for a step whose KV is all that counts (a draft's last)."""
        batch = len(inputs.seq_lens)
        size = self.padded_size(batch)
        assert size is not None and inputs.decode_only
        # One pinned host buffer per step, copied to the device in a single transfer (worker/staging.py):
        # token ids, positions, slots, then seq_lens, as int64 rows, and the batch's block tables.
        host = np.empty(4 * size, dtype=np.int64)
        host[:batch] = inputs.token_ids
        host[size : size + batch] = inputs.positions
        host[2 * size : 2 * size + batch] = inputs.slot_mapping
        host[3 * size : 3 * size + batch] = inputs.seq_lens
        if size > batch:  # padding rows: position 0, no KV write, one token of context
            host[batch:size] = 0
            host[size + batch : 2 * size] = 0
            host[2 * size + batch : 3 * size] = -1
            host[3 * size + batch : 4 * size] = 1
        staged, tables = stage([host, inputs.block_tables], self.token_ids.device)
        self.token_ids[:size].copy_(staged[:size])
        if feed is not None:
            self.token_ids[feed[0]] = feed[1]
        self.positions[:size].copy_(staged[size : 2 * size])
        self.slot_mapping[:size].copy_(staged[2 * size : 3 * size])
        self.seq_lens[:size].copy_(staged[3 * size :])
        # Only the columns this batch uses; the rest of each row is never read (seq_lens bounds the reads).
        # A padding row keeps whatever valid block ids it last held and reads one token of them.
        width = inputs.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(tables)
        self._graphs[size].replay()
        self.num_replays += 1
        return self._hidden[size][:batch]


def token_buckets(max_num_tokens: int, step: int = 256) -> list[int]:
    """Token counts that get piecewise graphs, ending with max_num_tokens: powers of two from step / 16 up to
    step, every step up to 8 * step, every 2 * step beyond (16, 32, 64, 128, 256, 512, ..., 2048, 2560, ...).
    A step pads to the next count: fewer than `step` padding tokens up to 8 * step, fewer than 2 * step
    beyond, where they are at most a fifth of the step's tokens."""
    sizes: list[int] = []
    size = max(1, step // 16)
    while size < max_num_tokens:
        sizes.append(size)
        size = size * 2 if size < step else size + (step if size < 8 * step else 2 * step)
    return [*sizes, max_num_tokens]


class MixedGraphs:
    """Piecewise CUDA graphs for prefill and mixed steps (on unless `--no-piecewise-graphs`).

    Such a step's attention depends on the batch's sequences (how many, how long, where their blocks are),
    which a graph cannot follow from step to step; everything else in the forward depends only on the
    number of tokens. So the forward is cut at each layer's attention into L + 1 pieces, captured for each
    padded token count: the embedding and layer 0's first half (norm, QKV projection, q/k norms, RoPE), then
    layer i-1's second half (output projection, norm, MLP) with layer i's first half, and last layer L-1's
    second half with the final norm. A step replays the pieces of the smallest count that holds it and runs
    each layer's attention (the KV write and the Triton kernel, a few launches) eagerly in between. The
    pieces hand over through static buffers: q, k, v and the residual stream out of a piece, the attention
    output into the next. Padding tokens are token 0 at position 0; their rows are computed and never read
    (attention and the KV write see only the step's own tokens).

    `capture=False` runs the same pieces eagerly, on any device: what the tests compare with the model's
    own forward on the CPU.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[KVCache],
        max_num_tokens: int,
        device: torch.device,
        bucket_step: int = 256,
        capture: bool = True,
        show_progress: bool = True,
    ) -> None:
        assert model.num_layers > 0
        self.model = model
        self.kv_layers = kv_layers
        self.sizes = token_buckets(max_num_tokens, bucket_step)
        n = self.sizes[-1]
        c = model.attention_shape  # this rank's heads
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        act = {"dtype": model.dtype, "device": device}
        self.residual = torch.zeros(n, model.config.hidden_size, **act)  # [N, H]
        self.q = torch.zeros(n, c.num_heads, c.head_dim, **act)  # [N, Hq, D]
        self.k = torch.zeros(n, c.num_kv_heads, c.head_dim, **act)  # [N, Hkv, D]
        self.v = torch.zeros(n, c.num_kv_heads, c.head_dim, **act)  # [N, Hkv, D]
        self.attended = torch.zeros(n, c.q_size, **act)  # [N, q_size]
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._hidden: dict[int, torch.Tensor] = {}  # the last piece's output, per size
        self.captured = capture
        self.capture_time_s = 0.0
        self.num_runs = 0  # steps run
        if capture:
            self._capture(show_progress)

    def padded_size(self, num_tokens: int) -> int | None:
        """The graphs that run a step of `num_tokens` tokens, or None when it is too large."""
        if num_tokens > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_tokens)

    def _piece(self, i: int, size: int) -> torch.Tensor | None:
        """Piece i of a `size`-token step. It leaves layer i's q, k, v and the residual stream in the static
        buffers; the last piece (i = L) returns the final hidden states instead."""
        m = self.model
        residual: torch.Tensor | None
        if i == 0:
            hidden, residual = m.embed(self.token_ids[:size]), None
        else:
            hidden, residual = m.attention_outputs(i - 1, self.attended[:size], self.residual[:size])
        if i == m.num_layers:
            return m.final_norm(hidden, residual)
        q, k, v, residual = m.attention_inputs(i, self.positions[:size], hidden, residual)
        for buf, t in ((self.q, q), (self.k, k), (self.v, v), (self.residual, residual)):
            if t.data_ptr() != buf.data_ptr():  # the fused norm updates the residual buffer in place
                buf[:size].copy_(t)
        return None

    @torch.inference_mode()
    def _capture(self, show_progress: bool) -> None:
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller sizes reuse the memory of the larger ones from the shared pool.
        for n, size in enumerate(reversed(self.sizes)):
            graphs = []
            for i in range(self.model.num_layers + 1):
                self._piece(i, size)  # warm-up: compiles kernels, allocates their buffers outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._piece(i, size)
                graphs.append(graph)
                if out is not None:
                    self._hidden[size] = out
            self._graphs[size] = graphs
            if show_progress:
                _progress(n + 1, len(self.sizes), started, "piecewise CUDA graphs")
        torch.cuda.synchronize()
        self.capture_time_s = time.monotonic() - started

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward of a step (token ids and positions [T] and its metadata, on the device):
        the final hidden states [T, H]."""
        num_tokens = token_ids.shape[0]
        size = self.padded_size(num_tokens)
        assert size is not None
        self.token_ids[:num_tokens].copy_(token_ids)
        self.positions[:num_tokens].copy_(positions)
        if size > num_tokens:
            self.token_ids[num_tokens:size].zero_()
            self.positions[num_tokens:size].zero_()
        num_layers = self.model.num_layers
        hidden = None
        for i in range(num_layers + 1):
            if self.captured:
                self._graphs[size][i].replay()
            else:
                hidden = self._piece(i, size)
            if i < num_layers:
                q, k, v = self.q[:num_tokens], self.k[:num_tokens], self.v[:num_tokens]
                attended = self.model.attend(i, q, k, v, self.kv_layers[i], meta)
                self.attended[:num_tokens].copy_(attended)
        if self.captured:
            hidden = self._hidden[size]
        self.num_runs += 1
        assert hidden is not None
        return hidden[:num_tokens]
