"""One step's grammar work on the host, batched: advancing the constrained rows' matchers by the tokens
their sequences gained and filling their next-token bitmasks, in xgrammar's batched calls, into a reused host
buffer that goes to the device in one transfer.

xgrammar's batched accept and fill release the GIL, so their C++ runs in parallel on several threads; the
Python between them does not, and every thread that runs it takes the GIL from the worker's main thread,
which launches the GPU's work. So one background thread does all the Python over a step's rows, and the
calls are made on as many threads as the rows' work pays for (`GrammarBatch`): in the steady state (a row
gains one token a step) the rows are dealt out in chunks, each accepted and filled by one thread in two
calls (`GrammarBatch._run_chunks`); rows that catch up by several tokens go through `advance_and_fill` with
xgrammar's own fill threads. Measured on an H200's 16-core host (docs/benchmarks.md, 2026-11-26), the
JSON-schema workload against the plain one: 0.68 with 12 threads that each ran the Python over a chunk, 0.84
with one thread and xgrammar's 12 fill threads, and with the chunks 0.92 where a run's fills took 6 threads
but 0.80 where they took 9-10 (the main thread's launches 3 ms slower a step): hence at most 8 threads, one
per 0.5 ms of a run's measured work.
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

log = logging.getLogger(__name__)

# A thread's share of a run's work worth taking it for: each takes the GIL to start and end its calls, and
# xgrammar starts its own fill threads in every fill (tens of microseconds each, more under load)
WORK_PER_THREAD_S = 500e-6
MIN_MEASURED_ROWS = 8  # fills of fewer rows are not averaged into a row's cost: their fixed costs dominate
PROBE_EVERY = 64  # fills on several threads between two on one thread, which measure a row's work again
# one a step copied to the device, two filled ahead (after the copy, behind the forward), the merge
NUM_HOST_BUFFERS = 4


def default_grammar_threads() -> int:
    """The most threads a step's masks take: half the cores this process may run on (the rest run the
    worker's main thread, the scheduler's and the api's processes), at least 1, at most 8 (module doc)."""
    cores = os.cpu_count() or 2
    try:
        cores = min(cores, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        pass
    return max(1, min(8, cores // 2))


@dataclass
class Matcher:
    """One constrained sequence's grammar state in the worker."""

    matcher: xgr.GrammarMatcher | None  # None: the grammar failed; only the stop tokens are allowed
    stop_ids: tuple[int, ...]  # the tokens that end it (EOS and the request's stop tokens), sorted
    seq_id: int = -1
    kind: int = 0  # its row of the JSON-safe words (worker/structured.py): 0 none, 1 + any_whitespace
    num_fed: int = 0  # generated tokens accepted so far (or skipped: past the grammar's end)
    # It accepted a stop token (xgrammar's matchers end only so: terminate_without_stop_token is off), kept
    # here so that a step asks xgrammar only about the rows that just accepted one.
    terminated: bool = False


try:  # xgrammar's batched accept without its Python wrapper, which reads the result row by row
    from xgrammar.matcher import _core as _xgrammar_core

    _BATCH_ACCEPT = _xgrammar_core.BatchGrammarMatcher.batch_accept_token
except (ImportError, AttributeError):  # (another xgrammar: its public call)
    _BATCH_ACCEPT = None


def batch_accept(matchers: list[xgr.GrammarMatcher], tokens: list[int]) -> list[bool] | None:
    """Feeds matchers[i] tokens[i] in one batched call. Returns None when every token was accepted (almost
    every call: the tokens were drawn under the masks), else each token's acceptance. The public
    `BatchGrammarMatcher.batch_accept_token` turns its result into Python booleans one element at a time
    (0.2 ms of 450 rows on this CPU, 40% of the call), where testing the result for a 0 takes microseconds."""
    if _BATCH_ACCEPT is None:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return None if all(accepted) else accepted
    result = _BATCH_ACCEPT([m._handle for m in matchers], tokens, False)
    return None if 0 not in result else [bool(ok) for ok in result]


def advance_and_fill(
    batch: xgr.BatchGrammarMatcher,
    states: list[Matcher],
    tokens: list[list[int]],
    mask: torch.Tensor,
    out_rows: list[int] | None = None,
    spent: list[float] | None = None,
) -> list[int]:
    """Feeds each matcher (states[i]) its tokens (tokens[i], oldest first), then fills the bitmask rows
    (`mask` [N, W] int32, row out_rows[i], or i) of the matchers still running. Returns the rows (indices
    into `states`) whose matcher is done: terminated, failed before, or broken by a token its grammar
    refuses (its `matcher` set to None); their bitmask rows are left for the caller to fill with their stop
    tokens.
    `spent`, when given, gets this call's seconds in the accept and in the fill added to its two entries.

    Tokens past a matcher's end (which a pipelined step drew after the stop token, and which are dropped)
    are counted as fed and not accepted. Python per row is kept to list comprehensions: at ~900 rows a
    step it costs as much as xgrammar's own work."""
    started = time.perf_counter()
    rows = range(len(states))
    depth = max(map(len, tokens), default=0)
    for k in range(depth):  # one token of each row per batched call: rows gain one token per step
        live = [
            i
            for i in rows
            if len(tokens[i]) > k and states[i].matcher is not None and not states[i].terminated
        ]
        if not live:
            break
        fed = [tokens[i][k] for i in live]
        accepted = batch_accept([states[i].matcher for i in live], fed)
        stopping = [i for i, token in zip(live, fed, strict=True) if token in states[i].stop_ids]
        _after_accept(states, live, fed, accepted, stopping)
    for i in rows:
        states[i].num_fed += len(tokens[i])
    accepted_at = time.perf_counter()
    running = [i for i in rows if states[i].matcher is not None and not states[i].terminated]
    if running:
        indices = running if out_rows is None else [out_rows[i] for i in running]
        batch.batch_fill_next_token_bitmask([states[i].matcher for i in running], mask, indices)
    if spent is not None:
        spent[0] += accepted_at - started
        spent[1] += time.perf_counter() - accepted_at
    return _done_rows(states)


def _after_accept(
    states: list[Matcher], fed_rows: list[int], fed: list[int], accepted: list[bool] | None, stopping: Any
) -> None:
    """After a batched accept of token fed[j] by the matcher of row fed_rows[j] (`accepted`: None when all
    were accepted): a matcher whose grammar refused its token is broken (None), and the rows in `stopping`
    (fed a stop token) are terminated, or broken."""
    if accepted is not None:
        for i, token, ok in zip(fed_rows, fed, accepted, strict=True):
            if not ok:
                log.error("sequence %d: token %d breaks its grammar", states[i].seq_id, token)
                states[i].matcher = None
    for i in stopping:
        m = states[i].matcher
        states[i].terminated = m is None or m.is_terminated()


def _done_rows(states: list[Matcher]) -> list[int]:
    """The rows whose matcher is done: terminated, or broken (None)."""
    return [i for i, state in enumerate(states) if state.matcher is None or state.terminated]


class GrammarBatch:
    """A step's rows advanced and filled on as many threads as their work pays for (module doc): in chunks
    when each row gains one token at most, else `advance_and_fill` with xgrammar's fill threads.

    A thread is worth taking only with enough rows' work to share: a row of the benchmark checkpoints'
    4,096-token tokenizer accepts and fills in microseconds, one of a 128k-token tokenizer in tens. A row's
    work (accept and fill) is measured on runs made on one thread (a run on several counts their starts
    too, and would inflate it); each run takes one thread per `WORK_PER_THREAD_S` of expected work, within
    [1, threads], and every `PROBE_EVERY`-th run that would take several takes one, to measure again (rows
    grow costlier or cheaper as outputs go on)."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_grammar_threads()  # the most a fill takes
        self.last_spent = [0.0, 0.0]  # the last `run`'s seconds in the accept and in the fill
        self.last_threads = 1  # the threads the last `run`'s fill took
        self.row_fill_s = 0.0  # a row's accept and fill in seconds of one thread, averaged; 0: not yet
        self._batches: dict[int, xgr.BatchGrammarMatcher] = {}
        self._parallel_fills = 0  # fills on several threads since the last one on one
        self._chunk_pool: ThreadPoolExecutor | None = None  # `_run_chunks`' threads but the caller's
        self._chunk_batches: list[xgr.BatchGrammarMatcher] = []  # one a chunk, one thread each

    def threads_for(self, rows: int) -> int:
        """The threads a fill of `rows` rows takes: one until a fill has been measured, and as a probe."""
        work = rows * self.row_fill_s
        threads = max(1, min(self.threads, round(work / WORK_PER_THREAD_S)))
        if threads > 1 and self._parallel_fills >= PROBE_EVERY:
            return 1
        return threads

    def run(
        self,
        states: list[Matcher],
        tokens: list[list[int]],
        mask: torch.Tensor,
        out_rows: list[int] | None = None,
    ) -> list[int]:
        """`advance_and_fill` over every row (row i: states[i], tokens[i], mask[out_rows[i]] or mask[i]).
        Returns the done rows (indices into `states`); `last_spent` then holds its (accept, fill) seconds
        and `last_threads` the fill's threads."""
        n = len(states)
        # (every row counts: the done ones are not filled, but which are is known only after the accept)
        threads = self.last_threads = self.threads_for(n)
        batch = self._batches.get(threads)
        if batch is None:
            batch = self._batches[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        spent = [0.0, 0.0]
        if threads > 1 and max(map(len, tokens), default=0) <= 1:
            done = self._run_chunks(threads, states, tokens, mask, out_rows, spent)
        else:
            done = advance_and_fill(batch, states, tokens, mask, out_rows, spent)
        self.last_spent = spent
        filled = n - len(done)
        if threads > 1:
            self._parallel_fills += 1
        elif filled >= MIN_MEASURED_ROWS:
            self._parallel_fills = 0
            per_row = (spent[0] + spent[1]) / filled
            self.row_fill_s = per_row if self.row_fill_s == 0.0 else 0.8 * self.row_fill_s + 0.2 * per_row
        return done

    def _run_chunks(
        self,
        chunks: int,
        states: list[Matcher],
        tokens: list[list[int]],
        mask: torch.Tensor,
        out_rows: list[int] | None,
        spent: list[float],
    ) -> list[int]:
        """`advance_and_fill` of rows that gain one token at most (a step's, the steady state), the rows
        dealt out in `chunks` contiguous chunks, each accepted and filled by one thread in two of xgrammar's
        calls (both release the GIL). The Python over the rows stays on the calling thread: threads that
        ran it too took the GIL from the worker's main thread (module doc). A row fed a stop token is done
        (terminated, or broken if its grammar refused it) and is not filled."""
        started = time.perf_counter()
        n = len(states)
        out = range(n) if out_rows is None else out_rows
        live = [i for i in range(n) if states[i].matcher is not None and not states[i].terminated]
        fed = [i for i in live if tokens[i]]
        stopping = {i for i in fed if tokens[i][0] in states[i].stop_ids}
        for i in range(n):  # (a token past a matcher's end too: counted, not accepted)
            states[i].num_fed += len(tokens[i])
        running = [i for i in live if i not in stopping]
        fed_matchers = [states[i].matcher for i in fed]
        fed_tokens = [tokens[i][0] for i in fed]
        run_matchers = [states[i].matcher for i in running]
        run_rows = [out[i] for i in running]
        bounds = [n * c // chunks for c in range(chunks + 1)]
        fed_at = [bisect_left(fed, b) for b in bounds]
        run_at = [bisect_left(running, b) for b in bounds]
        while len(self._chunk_batches) < chunks:
            self._chunk_batches.append(xgr.BatchGrammarMatcher(max_threads=1))

        def chunk(c: int) -> tuple[list[bool] | None, float, float]:
            t0 = time.perf_counter()
            a, b = fed_at[c], fed_at[c + 1]
            accepted = batch_accept(fed_matchers[a:b], fed_tokens[a:b]) if b > a else None
            t1 = time.perf_counter()
            a, b = run_at[c], run_at[c + 1]
            if b > a:
                self._chunk_batches[c].batch_fill_next_token_bitmask(run_matchers[a:b], mask, run_rows[a:b])
            return accepted, t1 - t0, time.perf_counter() - t1

        if self._chunk_pool is None:
            self._chunk_pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="grammar-fill")
        prepared = time.perf_counter()
        jobs = [self._chunk_pool.submit(chunk, c) for c in range(1, chunks)]
        try:
            first = chunk(0)
        finally:  # (no chunk still writes the mask once this returns, or raises)
            rest = [job.result() for job in jobs]
        results = [first, *rest]
        ended = time.perf_counter()
        accepted: list[bool] | None = None  # (the chunks' answers in row order, where one refused a token)
        if any(r[0] is not None for r in results):
            accepted = []
            for c, (answer, _, _) in enumerate(results):
                accepted += answer if answer is not None else [True] * (fed_at[c + 1] - fed_at[c])
        _after_accept(states, fed, fed_tokens, accepted, stopping)
        accept_s = (prepared - started) + max(r[1] for r in results)
        spent[0] += accept_s
        spent[1] += (ended - started) - accept_s
        return _done_rows(states)

    def close(self) -> None:
        """Stops the chunk threads (xgrammar's own live only within a fill)."""
        if self._chunk_pool is not None:
            self._chunk_pool.shutdown(wait=False)


def fill_stop_rows(mask: torch.Tensor, rows: list[tuple[int, tuple[int, ...]]]) -> None:
    """Sets each (row, stop token ids) row of `mask` ([N, W] int32) to allow exactly its stop tokens."""
    if not rows:
        return
    words = mask.numpy().view(np.uint32)
    by_stop: dict[tuple[int, ...], list[int]] = {}
    for index, stop in rows:
        by_stop.setdefault(stop, []).append(index)
    for stop, indices in by_stop.items():
        row = np.zeros(words.shape[1], dtype=np.uint32)
        for t in stop:
            if t // 32 < len(row):
                row[t // 32] |= np.uint32(1 << (t % 32))
        words[indices] = row


@dataclass
class HostMasks:
    """One step's constrained rows and their masks on the host, as `_host_masks` made them."""

    rows: list[int]  # indices into the step's sampling rows
    host: torch.Tensor  # [rows n | kinds n | bitmask n * W] int32, packed for one transfer
    seq_ids: list[int]  # the rows' sequences
    states: list[Matcher]  # the rows' matchers, fed up to what their masks were filled from
    spent: tuple[float, float] = (0.0, 0.0)  # seconds in the accept, in the fill
    took_s: float = 0.0  # the whole call's
    reused: int = 0  # rows whose masks came from the ones filled ahead

    def taken_whole(self, seq_ids: list[int], samplers: list[Any]) -> HostMasks | None:
        """These masks, all kept (a prefetch made them for this step), when they are of exactly the step's
        constrained rows (`samplers`: its SeqStates), as they are unless the step changed in between; else
        None, and the step's are made anew."""
        rows = [j for j, s in enumerate(samplers) if s.params.structured is not None]
        if self.rows != rows or self.seq_ids != [seq_ids[j] for j in rows]:
            return None
        self.reused = len(rows)
        return self


class HostMaskBuffers:
    """Host buffers for the steps' packed masks, reused: on CUDA four pinned ones taken in turn (a step
    may take three: the rows filled once the step before it is copied, behind its forward, its merge),
    each only once its last copy to the device has finished (long before: the step that read it has
    answered), so that the copy queues without waiting and no step allocates. Elsewhere a fresh tensor
    per take (the sampler reads it synchronously there). Each grows to the largest step seen."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * NUM_HOST_BUFFERS
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_HOST_BUFFERS
        self._index: dict[int, int] = {}  # a buffer's data_ptr -> its index
        self._next = 0

    def take(self, numel: int) -> torch.Tensor:
        """A flat int32 host tensor of `numel` elements, free to overwrite (the two taken before it are
        not: the one filled ahead and the step's merge)."""
        if not self.pinned:
            with torch.inference_mode(False):
                return torch.empty(numel, dtype=torch.int32)
        i = self._next
        self._next = (i + 1) % NUM_HOST_BUFFERS
        if self._copied[i] is not None:
            self._copied[i].synchronize()
            self._copied[i] = None
        buffer = self._buffers[i]
        if buffer is None or buffer.numel() < numel:
            with torch.inference_mode(False):  # written in and out of it (the prefetch thread)
                buffer = self._buffers[i] = torch.empty(numel, dtype=torch.int32, pin_memory=True)
            self._index[buffer.data_ptr()] = i
        return buffer[:numel]

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`host` (from `take`) on `device`, in one transfer that does not wait for the device's queue."""
        if not self.pinned:
            return host if device.type == "cpu" else host.to(device)
        out = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._index[host.data_ptr()]] = event
        return out
