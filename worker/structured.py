"""Structured output in the worker: one xgrammar matcher per constrained sequence, the next-token bitmasks of
a step's sampling rows, and their application to the logits in the sampler.

The matchers live here, not in the scheduler, because the scheduler plans step N+1 before step N's tokens
are back and the worker appends the sampled tokens itself. A matcher is advanced for the step in which its
sequence next samples: once step N's tokens are on the host, step N+1's matchers are fed the tokens their
sequences gained since (`num_fed` counts them) and its bitmasks filled, in the background (`prefetch`, in
batched calls over a few threads: worker/grammar_batch.py) while step N's answer goes out and the GPU runs
step N+1's forward pass, queued before; the sampler takes them last. The same catch-up rebuilds the state
of a sequence recomputed after preemption (a fresh matcher replays its generated tokens, SeqState.prompt_len
says where they start), of a fork child or a clone (it replays its parent's output), and of a swapped-in
sequence (its SeqState, and so its matcher, stayed). Every tensor-parallel rank holds the same sequences,
samples the same tokens and so fills the same masks.

The masks are as wide as the tokenizer's vocabulary, not the logits (a checkpoint's logits can be wider: the
benchmarks' Llama-3.2-1B shape has 128,256 logits and a 4,096-token tokenizer): the ids past it have no text,
no grammar allows them, and the mask kernel bans every token past a mask's words. That keeps xgrammar from
clearing every such id in each row it fills (about 150 µs a row in a string) and the host buffer and its
transfer small. A request's stop token id past the tokenizer's vocabulary is not allowed under a grammar.

Grammars compile in a thread pool, started when the NewSequence arrives, cached by their StructuredOutput.
A grammar that fails to compile (or does not finish within `compile_timeout_s` when the sequence must
sample) leaves its sequence with only the stop tokens allowed: that sequence ends at once, the others go on.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from pagedserve.common.grammars import GrammarError, compile_grammar
from pagedserve.common.messages import StepPlan
from pagedserve.common.sampling_params import StructuredOutput
from pagedserve.kernels.reference_bitmask import apply_token_bitmask_reference
from pagedserve.worker.grammar_batch import (
    GrammarBatch,
    HostMaskBuffers,
    HostMasks,
    Matcher,
    default_grammar_threads,
    fill_stop_rows,
)
from pagedserve.worker.sequences import SeqState

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept for reuse (a 128k vocabulary's can be megabytes each)
COMPILE_TIMEOUT_S = 20.0  # how long a sequence that must sample waits for its grammar (the step waits too)


@dataclass(frozen=True)
class TokenBitmask:
    """The constrained rows of one step and their allowed tokens, on the sampler's device."""

    rows: torch.Tensor  # [n] int64: logits rows (the step's sampling order)
    bitmask: torch.Tensor  # [n, ceil(V / 32)] int32: bit t % 32 of word t // 32 allows token t
    kinds: torch.Tensor | None = None  # [n] int32: each row's row of `extra` (None: none)
    extra: torch.Tensor | None = None  # [K, ceil(V / 32)] int32: words ANDed into the rows' bitmasks


class StructuredOutputs:
    """The grammar compiler and the matchers of the worker's constrained sequences, by seq id."""

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device | None = None,  # the sampler's: on CUDA the masks' host buffers are pinned
        grammar_threads: int | None = None,  # None: from the CPU count (worker/grammar_batch.py)
    ) -> None:
        self.vocab_size = vocab_size
        self.mask_vocab_size = vocab_size  # the tokenizer's (<= vocab_size): set with the compiler
        self.eos_token_ids = list(eos_token_ids)
        self.compile_timeout_s = COMPILE_TIMEOUT_S
        self._json_words: dict[int, torch.Tensor] = {}  # by any_whitespace: set with the compiler
        threads = default_grammar_threads()
        # compiles: at most 8 at once, so that they leave the steps' grammar threads some cores
        self._pool = ThreadPoolExecutor(max_workers=min(8, threads), thread_name_prefix="grammar")
        # The tokenizer's vocabulary is read once, in the background: a worker that never sees a
        # constrained request never waits for it.
        self._compiler: Future[xgr.GrammarCompiler] = self._pool.submit(self._make_compiler, model_dir)
        self._compiled: OrderedDict[StructuredOutput, Future[xgr.CompiledGrammar]] = OrderedDict()
        self.batch = GrammarBatch(grammar_threads or threads)  # the steps' advance and fill
        self._device = device or torch.device("cpu")
        if self._device.type == "cuda" and self._device.index is None:  # the index the prefetch thread sets
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._buffers = HostMaskBuffers(self._device)
        # _extra_words by (device, width, with the JSON words): the width is set with the compiler
        self._extra: dict[tuple[torch.device, int, bool], torch.Tensor] = {}
        self.matchers: dict[int, Matcher] = {}
        self._failed: dict[int, list[int]] = {}  # by step id: the seq ids whose constraint failed
        self._step_id = 0  # the step whose bitmask is being made
        # `prefetch`: one step's host work at a time, in the background; (step id, its future)
        self._step_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-prefetch")
        self._prefetched: tuple[int | None, Future[HostMasks | None]] | None = None
        self.fill_ahead = True  # `prefetch` ahead of the plan (off: benchmarks compare without it)
        # The last `bitmask`'s costs (host ms, rows), for the worker's step trace (worker/step_trace.py)
        self.last_stats: dict[str, float] = {}

    def _make_compiler(self, model_dir: str) -> xgr.GrammarCompiler:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # The tokenizer's ids (and the stop tokens), within the logits' width: the ids past it are never
        # allowed (the mask kernel bans the tokens past a mask's words).
        ids = [len(tokenizer) - 1, *tokenizer.get_vocab().values(), *self.eos_token_ids]
        size = min(self.vocab_size, 1 + max(ids))
        eos = self.eos_token_ids
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=eos)
        self.mask_vocab_size = size  # before the JSON words: words of this width come with this width
        self._json_words = {ws: _json_safe_words(info.decoded_vocab, size, ws) for ws in (0, 1)}
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, structured: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        future = self._compiled.get(structured)
        if future is None:
            future = self._pool.submit(lambda: compile_grammar(self._compiler.result(), structured))
            self._compiled[structured] = future
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured)
        return future

    def on_plan(self, plan: StepPlan) -> None:
        """A plan was applied: start compiling the new sequences' grammars, forget the freed sequences'."""
        for seq_id in plan.freed_seq_ids:
            self.matchers.pop(seq_id, None)
        for new in plan.new_seqs:
            self.matchers.pop(new.seq_id, None)  # recomputed after preemption: a fresh matcher replays
            if new.params.structured is not None:
                self._compile(new.params.structured)

    def reset(self) -> None:
        try:
            self._join_prefetched()
        except Exception:  # a failed step's work: nothing of it is used
            log.exception("structured output: the prefetched step failed")
        self.matchers.clear()
        self._failed.clear()

    def _matcher(self, seq_id: int, seq: SeqState) -> Matcher:
        state = self.matchers.get(seq_id)
        if state is not None:
            return state
        structured = seq.params.structured
        assert structured is not None
        stop_ids = self._stop_ids(seq)
        kind = 1 + structured.any_whitespace if structured.kind in ("json_schema", "json_object") else 0
        state = Matcher(None, stop_ids, seq_id, kind)
        try:
            compiled = self._compile(structured).result(timeout=self.compile_timeout_s)
            # (after the compile, and so the tokenizer: ids past the masks' vocabulary have no text,
            # xgrammar refuses them, and they stay banned)
            stop = [t for t in stop_ids if t < self.mask_vocab_size] or None
            state.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop)
        except (GrammarError, FutureTimeout, Exception) as e:  # a grammar, or the checkpoint's tokenizer
            log.error("structured output for sequence %d fails: %s", seq_id, e or "compile timed out")
            self._compiled.pop(structured, None)
            self._failed.setdefault(self._step_id, []).append(seq_id)
        self.matchers[seq_id] = state
        return state

    def prefetch(self, step_id: int | None, seq_ids: list[int], samplers: list[SeqState]) -> None:
        """Starts the host work of the next step's bitmask (advance, fill) in the background, once the
        rows' tokens are all on the host (the runner calls it when a step has finished, before its answer
        is sent). `step_id`: the step forwarded behind it, whose rows these are (rows already filled by
        `prefill_after` are taken as they are); None: no plan is there yet, and these are the finished
        step's rows, which the next step mostly samples again: they fill ahead of the plan (unless
        `prefill_after` does already). `bitmask` then takes every row filled ahead that it samples and that
        gained no token since, and does only the others."""
        prior = self._prefetched
        if step_id is None and (prior is not None or not self.fill_ahead):
            return
        if any(s.params.structured is not None for s in samplers):
            before = prior[1] if prior is not None else None  # (the pool runs one job at a time, in order)
            job = self._step_pool.submit(self._prefetch, step_id, list(seq_ids), list(samplers), before)
            self._prefetched = (step_id, job)

    def prefill_after(self, step: Any) -> None:
        """Once the sampled tokens of `step` (a LaunchedStep, just queued) reach the host, its rows'
        matchers accept them and fill their masks, in the background: a thread waits for the step's copy,
        so that the next step's masks do not wait for the worker to finish this step (which it does only
        after it has launched the next step's forward, or once the next plan is there)."""
        if not self.fill_ahead or step.spec is not None or step.copy is None:
            return
        self._join_prefetched()  # (normally none: the step's own bitmask took it)
        matchers = self.matchers
        rows = [
            j
            for j, (seq_id, s) in enumerate(zip(step.seq_ids, step.samplers, strict=True))
            if s.params.structured is not None and s.pending and seq_id in matchers
        ]
        if rows:
            # (the lengths now: `received` appends the token while the thread may read the tokens)
            ends = {step.seq_ids[j]: len(step.samplers[j].token_ids) for j in rows}
            seq_ids, samplers = [step.seq_ids[j] for j in rows], [step.samplers[j] for j in rows]
            job = self._step_pool.submit(self._prefetch, None, seq_ids, samplers, None, step, ends)
            self._prefetched = (None, job)

    def _prefetch(
        self,
        step_id: int | None,
        seq_ids: list[int],
        samplers: list[SeqState],
        before: Future[HostMasks | None] | None = None,
        step: Any = None,  # prefill_after's: its tokens are the pending ones, up to `ends` before them
        ends: dict[int, int] | None = None,
    ) -> HostMasks | None:
        ahead = before.result() if before is not None else None
        pending = dict if step is None else lambda: step_tokens(step)
        if self._device.type != "cuda":
            return self._host_masks(step_id, seq_ids, samplers, pending, ahead, ends)
        with torch.cuda.device(self._device):  # a new pinned buffer: this worker's GPU, not GPU 0's
            return self._host_masks(step_id, seq_ids, samplers, pending, ahead, ends)

    def _join_prefetched(self) -> tuple[int | None, HostMasks | None] | None:
        """The prefetched work's (step id, host masks), once done; None when none was started."""
        job, self._prefetched = self._prefetched, None
        return None if job is None else (job[0], job[1].result())

    def bitmask(
        self,
        step_id: int,
        seq_ids: list[int],
        samplers: list[SeqState],
        pending_tokens: Any,  # () -> {seq_id: token} of the step in flight, called only when needed
        device: torch.device,
    ) -> TokenBitmask | None:
        """The bitmask of the constrained rows among `samplers` (the step's sampling rows), each matcher
        first fed the tokens its sequence gained since it last sampled; None when no row is constrained.
        The rows' matchers advance and fill their rows in batched calls over `self.batch`'s threads (or
        did so already: `prefetch`), into a reused host buffer that goes to `device` in one transfer that
        waits for nothing. `last_stats` then holds what it cost."""
        started = time.perf_counter()
        prefetched = self._join_prefetched()
        joined = time.perf_counter()
        ahead = prefetched[1] if prefetched is not None else None
        masks = None
        if prefetched is not None and prefetched[0] == step_id and ahead is not None:
            # Made for this very step, from its rows once all their tokens were on the host (`prefetch`):
            # taken whole, without the row-by-row check below on this (the launching) thread.
            masks = ahead.taken_whole(seq_ids, samplers)
        if masks is None:  # (a matcher a prefetch fed is not fed again: each counts the tokens it accepted)
            masks = self._host_masks(step_id, seq_ids, samplers, pending_tokens, ahead)
        computed = time.perf_counter()
        if masks is None:
            self.last_stats = {}
            return None
        n = len(masks.rows)
        num_words = len(masks.host) // n - 2
        packed = self._buffers.to_device(masks.host, device)
        out = TokenBitmask(
            packed[:n].long(),
            packed[2 * n :].view(n, num_words),
            packed[n : 2 * n],
            self._extra_words(device, num_words),
        )
        ahead_ms = ahead.took_s * 1e3 if ahead is not None else 0.0
        # (masks carry the cost of the rows they kept from `ahead`; a fill ahead of which they kept nothing
        # was spent too)
        wasted = ahead is not None and ahead is not masks and not masks.reused
        spent = [a + b for a, b in zip(masks.spent, ahead.spent, strict=True)] if wasted else masks.spent
        self.last_stats = {
            "rows": n,
            "ahead": 0 if prefetched is None else 1 if prefetched[0] is not None else 2,
            "reused_rows": masks.reused,
            "ahead_ms": round(ahead_ms, 3),
            "wait_ms": round((joined - started) * 1e3, 3),
            "host_ms": round((computed - joined) * 1e3, 3),
            "accept_ms": round(spent[0] * 1e3, 3),
            "fill_ms": round(spent[1] * 1e3, 3),
            "fill_threads": self.batch.last_threads,
            "copy_ms": round((time.perf_counter() - computed) * 1e3, 3),
        }
        return out

    def _host_masks(
        self,
        step_id: int | None,
        seq_ids: list[int],
        samplers: list[SeqState],
        pending_tokens: Any,
        ahead: HostMasks | None = None,
        ends: dict[int, int] | None = None,
    ) -> HostMasks | None:
        """The constrained rows, their matchers advanced and their masks packed [rows n | kinds n |
        bitmask n * W]; None when no row is constrained. `step_id` None: ahead of the plan, only the rows
        whose matcher exists. A row of `ahead` (masks filled before) whose matcher is still the same and
        has no new token keeps its mask (copied; or `ahead` itself when it has exactly these rows)."""
        started = time.perf_counter()
        matchers = self.matchers
        rows = [j for j, s in enumerate(samplers) if s.params.structured is not None]
        if step_id is None and ends is None:  # (no matcher made ahead: its sequence may be freed)
            rows = [j for j in rows if matchers.get(seq_ids[j]) is not None and not samplers[j].pending]
        if not rows:
            return None
        if step_id is not None:
            self._step_id = step_id
        n = len(rows)
        pending: dict[int, int] | None = None
        filled = {}  # a seq id -> its row of `ahead` and the matcher that filled it
        if ahead is not None:
            filled = {q: (k, m) for k, (q, m) in enumerate(zip(ahead.seq_ids, ahead.states, strict=True))}
        reuse_src: list[int] = []  # rows of `ahead` kept, for the rows reuse_dst
        reuse_dst: list[int] = []
        row_states: list[Matcher] = []
        states: list[Matcher] = []  # the matchers to advance and fill, rows out_rows
        tokens: list[list[int]] = []  # their tokens not yet accepted, oldest first
        out_rows: list[int] = []
        for k, j in enumerate(rows):
            seq, seq_id = samplers[j], seq_ids[j]
            state = matchers.get(seq_id)
            if state is None:  # (ahead: popped by a plan since; the row is redone with the step)
                state = self._matcher(seq_id, seq) if step_id is not None else Matcher(None, (), seq_id)
            row_states.append(state)
            # Its matcher accepts the tokens on the host up to `end`, then the one in flight, if any.
            end = ends[seq_id] if ends is not None else len(seq.token_ids)
            in_flight = ends is not None or seq.pending  # (prefill_after: every row's is)
            fed = seq.prompt_len + state.num_fed
            src, was = filled.get(seq_id, (-1, None))  # (current: the same matcher, fed them all)
            if was is state and fed == end + in_flight:
                reuse_src.append(src)
                reuse_dst.append(k)
                continue
            new = seq.token_ids[fed:end]
            if in_flight and fed <= end:  # (a matcher fed it before and its mask dropped: not again)
                pending = pending_tokens() if pending is None else pending
                new.append(pending[seq_id])
            states.append(state)
            tokens.append(new)
            out_rows.append(k)
        row_seq_ids = [seq_ids[j] for j in rows]
        if ahead is not None and not states and ahead.seq_ids == row_seq_ids and ahead.rows == rows:
            ahead.reused = n
            return ahead
        # (after the matchers: each waited for its grammar, and so for the tokenizer that sets the width)
        num_words = -(-self.mask_vocab_size // 32)
        host = self._buffers.take(n * (2 + num_words))
        # Written through numpy (and xgrammar) only: no torch op here, so the prefetch thread, outside
        # inference mode, can write a buffer that a step allocated in it.
        header = host[: 2 * n].numpy()
        header[:n] = rows
        header[n:] = [s.kind for s in row_states]  # each row's row of _extra_words
        mask = host[2 * n :].view(n, num_words)
        if reuse_dst:
            m = len(ahead.rows)
            ahead_words = ahead.host[2 * m :].numpy().reshape(m, -1)
            if ahead_words.shape[1] == num_words:
                mask.numpy()[reuse_dst] = ahead_words[reuse_src]
            else:  # (a width taken before the tokenizer came: the rows are redone)
                states += [row_states[k] for k in reuse_dst]
                tokens += [[] for _ in reuse_dst]
                out_rows += reuse_dst
                reuse_dst = []
        # (the rows kept from `ahead` were advanced and filled there: their cost goes on with them)
        spent = ahead.spent if reuse_dst else (0.0, 0.0)
        if states:
            done = self.batch.run(states, tokens, mask, out_rows)
            spent = (spent[0] + self.batch.last_spent[0], spent[1] + self.batch.last_spent[1])
            fill_stop_rows(mask, [(out_rows[i], states[i].stop_ids) for i in done])
        took = time.perf_counter() - started
        return HostMasks(rows, host, row_seq_ids, row_states, spent, took, len(reuse_dst))

    def _stop_ids(self, seq: SeqState) -> tuple[int, ...]:
        return tuple(sorted({*self.eos_token_ids, *seq.params.stop_token_ids}))

    def _extra_words(self, device: torch.device, num_words: int) -> torch.Tensor:
        """[3, W] int32 on `device` (W = `num_words`, the masks' width): every token (rows that are not
        JSON), then the JSON-safe tokens without and with any_whitespace. xgrammar 0.2.8 lets a
        length-bounded JSON string hold raw control characters, which JSON forbids (`{"maxLength": 5}`
        compiles to [^"\\\r\n]{0,5}): such tokens are never allowed in JSON output; the mask kernel ANDs
        these words in as it reads the bitmask."""
        words = self._json_words  # set with the compiler
        key = (device, num_words, bool(words))
        table = self._extra.get(key)
        if table is None:
            every = torch.full((num_words,), -1, dtype=torch.int32)
            if not words or len(words[0]) != num_words:
                # No tokenizer (or a step whose width was taken before it came): every constrained row
                # allows only its stop tokens, which are not JSON text.
                words = {0: every, 1: every}
            table = torch.stack([every, words[0], words[1]]).to(device)
            self._extra[key] = table
        return table

    def take_failed(self, step_id: int) -> list[int]:
        """The sequences of step `step_id` whose constraint failed (their mask allowed only the stop tokens):
        the step's output reports them, and the scheduler ends their requests with an error."""
        return self._failed.pop(step_id, [])

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._step_pool.shutdown(wait=True, cancel_futures=True)
        self.batch.close()


def _json_safe_words(decoded_vocab: list[bytes], vocab_size: int, any_whitespace: bool) -> torch.Tensor:
    """[ceil(V / 32)] int32 bitmask: the tokens without a byte JSON text never holds raw (0x00 to 0x1f;
    tab, newline and carriage return are whitespace between values when `any_whitespace`)."""
    allowed_controls = b"\t\n\r" if any_whitespace else b""
    bad = bytes(c for c in range(32) if c not in allowed_controls)
    safe = np.ones(-(-vocab_size // 32) * 32, dtype=np.uint8)
    for token_id, piece in enumerate(decoded_vocab[:vocab_size]):
        if piece.translate(None, bad) != piece:
            safe[token_id] = 0
    return torch.from_numpy(np.packbits(safe, bitorder="little").view(np.int32).copy())


def step_tokens(step: Any) -> dict[int, int]:
    """The tokens of a launched step (worker/model_runner.py LaunchedStep), by seq id; waits for them: the
    pending tokens of the step launched behind it, which its grammars must accept before it samples."""
    return dict(zip(step.seq_ids, step.copy.wait()[0], strict=True))


def apply_token_bitmask(logits: torch.Tensor, bitmask: TokenBitmask | None) -> torch.Tensor:
    """`logits` ([R, V]) with the tokens each constrained row's grammar forbids at -inf, in place: on CUDA
    one Triton launch over the constrained rows (kernels/token_bitmask.py), elsewhere its torch reference."""
    if bitmask is None:
        return logits
    n, num_words = bitmask.bitmask.shape
    kinds = bitmask.kinds
    if kinds is None:
        kinds = torch.zeros(n, dtype=torch.int32, device=logits.device)
    extra = bitmask.extra
    if extra is None:
        extra = torch.full((1, num_words), -1, dtype=torch.int32, device=logits.device)
    if logits.device.type == "cuda":
        from pagedserve.kernels.token_bitmask import (
            apply_token_bitmask as kernel,  # Triton: imported where it runs
        )

        return kernel(logits, bitmask.bitmask, bitmask.rows, kinds, extra)
    return apply_token_bitmask_reference(logits, bitmask.bitmask, bitmask.rows, kinds, extra)
