"""The worker's one operation: apply a StepPlan, run the batch, sample, answer a StepOutput.

The runner owns the model, the KV pools (worker/kv_cache.py) and the steps in flight; the sequences (their
tokens, block tables and computed-token counts, which the scheduler mirrors) are `Sequences`'
(worker/sequences.py), which checks and applies each plan's changes; the runner executes the step.

A step is launched (`launch`: the plan applied, the forward and the sampling queued on the device, the
sampled tokens' copy to the host started) and later finished (`finish`: wait for the tokens, append them,
answer). The worker launches step N+1 before it finishes step N when plan N+1 is already there, so the GPU
goes from one step to the next without waiting for the host; it queues step N+1's forward
(`launch_forward`), finishes step N, then queues step N+1's sampler (`launch_sampling`), so that the
sampler's host work does not hold back step N's answer and with it the scheduler's next plan. A token that
step N samples and step N+1 computes is then read by step N+1 on the device, straight from step N's sampler
output: the host counts it as pending in the sequence until step N finishes.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from dataclasses import replace

import numpy as np
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import StepOutput, StepPlan

from .attention import AttentionMetadata, get_attention_backend
from .batch_limits import resolve_max_num_seqs
from .cuda_graphs import DecodeGraphs, MixedGraphs
from .dummy_weights import init_dummy_weights
from .inputs import HostInputs, host_inputs
from .kv_cache import KVPools, cuda_kv_budget, determine_num_cpu_blocks, determine_num_kv_blocks
from .kv_tiers import attach_kv_tiers
from .launch_trace import LaunchTrace
from .loader import load_model_config, load_weights
from .logits_processors import LogitsProcessors
from .masked_rows import masked_seq_ids
from .memory_profile import profile_peak_memory
from .model_config import resolve_max_model_len
from .models.registry import build_model
from .parallel import ParallelContext
from .plan_check import PlanLimits
from .prompt_logprobs import PromptScores, score_prompts, select_prompt_rows, take_prompt_scores
from .sampler import sample_tensors
from .sequences import BlockTableArray, SeqState, Sequences
from .spec.decode_rows import verification_inputs
from .spec.factory import build_speculation
from .spec.verify import check_draft_slots, prepare_drafts
from .staging import stage
from .steps import ForwardedStep, LaunchedStep, batch_indices, step_sampling_tensors, verifies_drafts
from .structured import StructuredOutputs, step_tokens
from .warmup import warm_up_sampling_kernels


class ModelRunner:
    """Runs StepPlans on one device: the model, the KV pools, the sequences (worker/sequences.py) and the
    steps in flight."""

    def __init__(
        self, cfg: WorkerConfig, attention_backend: str = "torch", parallel: ParallelContext | None = None
    ) -> None:
        self.device = torch.device(cfg.resolved_device)
        self.dtype: torch.dtype = getattr(torch, cfg.resolved_dtype)
        self.kv_dtype: torch.dtype = getattr(torch, cfg.resolved_kv_cache_dtype)  # the pools' (FP8: 1 byte)
        self.block_size = cfg.block_size
        self.parallel = parallel or ParallelContext()  # a tensor-parallel rank, or the whole model (size 1)
        self.model_config = load_model_config(cfg.model, cfg.quantization)
        self.shard_config = self.parallel.shard_model_config(self.model_config)  # this rank's heads, for KV
        self.max_model_len = resolve_max_model_len(cfg, self.model_config)
        backend = get_attention_backend(attention_backend)
        self.model = build_model(
            self.model_config,
            self.max_model_len,
            backend,
            self.dtype,
            self.device,
            self.parallel,
            fused_ops=cfg.resolved_fused_ops,
        )
        if cfg.load_format == "dummy":  # random weights of the checkpoint's shapes (benchmarks)
            init_dummy_weights(self.model, self.model_config, cfg.seed, self.parallel)
        else:
            load_weights(self.model, self.model_config, cfg.model, self.parallel)
        self.model.eval()
        self.spec = build_speculation(cfg, self.device, self.dtype)  # before the profile: a draft's memory
        budget = 0
        # For the worker's memory line: the profile's peak (weights + one largest step), and the graphs' bytes
        self.profile_peak_bytes: int | None = None
        self.graph_bytes: int | None = None
        if self.device.type == "cuda" and cfg.num_kv_blocks <= 0:
            self.profile_peak_bytes = profile_peak_memory(self, cfg)
            budget = cuda_kv_budget(self.device, cfg.gpu_memory_utilization, self.profile_peak_bytes)
        draft_bytes = self.spec.kv_block_bytes if self.spec is not None else 0  # a draft model's pool
        num_blocks = determine_num_kv_blocks(
            cfg, self.shard_config, self.max_model_len, self.device, self.kv_dtype, budget, draft_bytes
        )
        num_cpu_blocks = determine_num_cpu_blocks(cfg, self.shard_config, self.kv_dtype)
        # Every rank runs the same plans on the same block ids: the group's pools take the smallest size.
        num_blocks = self.parallel.min_across_ranks(num_blocks)
        num_cpu_blocks = self.parallel.min_across_ranks(num_cpu_blocks)
        self.kv = KVPools(
            self.shard_config, num_blocks, num_cpu_blocks, self.block_size, self.kv_dtype, self.device
        )
        if self.spec is not None:
            self.spec.allocate_kv(num_blocks)
        # the largest decode batch (what the worker announces); by default it follows the pool
        self.max_num_seqs = resolve_max_num_seqs(cfg.max_num_seqs, self.kv.num_blocks, self.block_size)
        self.sequences = Sequences(
            PlanLimits(
                num_kv_blocks=self.kv.num_blocks,
                num_cpu_blocks=self.kv.num_cpu_blocks,
                vocab_size=self.model_config.vocab_size,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
                max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            )
        )
        attach_kv_tiers(self, cfg)  # host memory and disk below the pool, when configured (worker/kv_tiers/)
        self.structured = StructuredOutputs(
            cfg.model, self.vocab_size, self.eos_token_ids, self.device, cfg.grammar_threads or None
        )
        self.graphs: DecodeGraphs | None = None
        # The torch reference reads lengths on the host (a sync a graph cannot hold): it runs eagerly.
        if self.device.type == "cuda" and not cfg.enforce_eager and backend.graph_safe:
            # graph pools live outside the allocator's view
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self.graphs = DecodeGraphs(
                self.model,
                self.kv.layers,
                max_num_seqs=self.max_num_seqs,
                max_blocks_per_seq=self.tables.max_blocks_per_seq,
                max_model_len=self.max_model_len,
                device=self.device,
            )
        self.mixed_graphs: MixedGraphs | None = None
        if self.graphs is not None and cfg.piecewise_graphs:
            # Their memory comes out of what --gpu-memory-utilization leaves: the profile does not count it.
            max_tokens = cfg.max_num_batched_tokens
            self.mixed_graphs = MixedGraphs(self.model, self.kv.layers, max_tokens, self.device)
        if self.graphs is not None:
            self.graph_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.last_step_gpu_s = 0.0  # GPU time of the last step with a forward (CUDA; 0 elsewhere)
        self.in_flight: deque[LaunchedStep] = deque()  # launched, not finished; oldest first
        self.forwarded: ForwardedStep | None = None  # between launch_forward and launch_sampling
        self.prompt_scores: dict[int, PromptScores] = {}  # step id -> its prompt logprobs on their way
        self._last_ended: torch.cuda.Event | None = None  # the end of the last launched step on the GPU
        self.num_tokens_fed = 0  # tokens a step read from the previous step's sampler output on the device
        # With `trace_launches`: the host clock (perf_counter) at each phase of the last launch, by name
        self.trace_launches = False
        self.launch_marks: dict[str, float] = {}
        self.launch_trace = LaunchTrace(self.device)  # with it: the sampler's wait, the masks' costs
        eos = tuple(self.model_config.eos_token_ids)  # min_tokens bans them (with the stop ids)
        self.logits_processors = LogitsProcessors(self.model_config.vocab_size, eos, self.device)
        if self.spec is not None:  # (None: no --speculative-config)
            self.spec.with_limits(self.sequences.limits)
        warm_up_sampling_kernels(self.model, self.model_config.hidden_size, self.device)  # CUDA: compiled now

    def close(self) -> None:
        """Releases the CUDA graphs. Before a tensor-parallel group is destroyed this is required: NCCL
        does not destroy a communicator that a live graph captured (destroy_process_group hangs)."""
        if self.graphs is not None:
            torch.cuda.synchronize(self.device)  # no graph is still running when it goes
            self.graphs = None
            self.mixed_graphs = None
            gc.collect()
        self.structured.close()

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.kv.num_cpu_blocks

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def num_speculative_tokens(self) -> int:  # the most drafts per sequence and step (0: off)
        return self.spec.proposer_k if self.spec is not None else 0

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.model_config.eos_token_ids)

    @property
    def tables(self) -> BlockTableArray:
        """The sequences' block tables, which every step's inputs are cut from."""
        return self.sequences.tables

    def check_plan(self, plan: StepPlan) -> str | None:
        """Why `plan` contradicts this runner's state as it will be when the plan is applied (after the step
        in flight, if any), or None when `launch` can apply it. Changes nothing (worker/plan_check.py)."""
        return self.sequences.check_plan(plan) or check_draft_slots(plan, self.spec)

    def reset(self) -> None:
        """Finishes the steps in flight, dropping their outputs, and forgets every sequence: the runner is as
        freshly started, for a new scheduler. The KV pools stay allocated; what they hold is garbage that no
        sequence points to any more."""
        while self.in_flight:
            self.finish()
        self.sequences.clear()
        if self.spec is not None:
            self.spec.reset()  # the proposer forgets every sequence
        self.prompt_scores.clear()  # a step that failed between its selection and its end
        self.structured.reset()
        self.forwarded = None
        self._last_ended = None
        self.last_step_gpu_s = 0.0
        self.num_tokens_fed = 0
        self.launch_marks = {}
        self.launch_trace.clear()

    # -----------------------------------------------------------------------------------------------------
    # The step

    def _pending_feed(
        self, seq_ids: list[int], seqs: list[SeqState], inputs: HostInputs
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For the batch's pending tokens: (their flat input indices, the previous step's sampled tokens at
        them) on the device, or None when the batch has none."""
        fed = [b for b, s in enumerate(seqs) if s.pending]
        if not fed:
            return None
        previous = self.in_flight[-1]  # the only step a token can be pending from (see the worker loop)
        indices = np.empty((2, len(fed)), dtype=np.int64)
        indices[0] = inputs.query_start_loc[fed]
        indices[1] = [previous.row_of(seq_ids[b]) for b in fed]
        assert previous.tokens is not None
        on_device = self._put(indices)
        self.num_tokens_fed += len(fed)
        return on_device[0], previous.tokens[on_device[1]]

    def _put(self, a: np.ndarray) -> torch.Tensor:
        """`a` on the runner's device; on CUDA through pinned memory, so that the copy queues on the stream
        without waiting for the work before it."""
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _to_device(self, inputs: HostInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids [T], positions [T] and attention metadata on the runner's device."""
        arrays = [inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables]
        token_ids, positions, slots, tables, lens, starts = stage(
            [*arrays, inputs.seq_lens, inputs.query_start_loc], self.device
        )  # one pinned buffer, one copy (worker/staging.py)
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=lens,
            query_start_loc=starts,
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            num_decode_seqs=inputs.num_decode_seqs,
        )
        return token_ids, positions, meta

    def _forward(
        self, inputs: HostInputs, sampling: list[int], feed: tuple[torch.Tensor, torch.Tensor] | None,
        scores: PromptScores | None = None, rows: np.ndarray | None = None,
    ) -> torch.Tensor | None:  # fmt: skip
        """Runs the batch, its pending tokens put in from `feed`; returns the logits rows of the sequences at
        `sampling` (batch indices; `rows`: flat rows instead), or None when none samples. A decode batch a
        captured graph holds replays it; other steps replay the piecewise graphs (attention eagerly)."""
        batch = len(inputs.seq_lens)
        if self.graphs is not None and inputs.decode_only and self.graphs.padded_size(batch):
            if rows is not None and sampling and scores is None:  # verification: 1 + d rows per sampler
                return self.graphs.run(inputs, feed, self._put(rows))
            logits = self.graphs.run(inputs, feed)  # [B, V]
            score_prompts(scores, logits)  # one token per sequence: its flat row is its batch row
            if len(sampling) == batch:
                return logits
            return logits[self._put(np.array(sampling, dtype=np.int64))] if sampling else None
        token_ids, positions, meta = self._to_device(inputs)
        if feed is not None:
            token_ids[feed[0]] = feed[1]
        if self.mixed_graphs is not None and self.mixed_graphs.padded_size(len(inputs.token_ids)):
            hidden = self.mixed_graphs.run(token_ids, positions, meta)  # [T, H]
        else:
            hidden = self.model(token_ids, positions, meta, self.kv.layers)  # [T, H]
        score_prompts(scores, hidden, self.model.compute_logits, self.vocab_size)
        if not sampling:
            return None
        # The last scheduled token of each sampling sequence is the row that predicts its next token.
        last = (inputs.query_start_loc[1:][sampling] - 1).astype(np.int64) if rows is None else rows
        return self.model.compute_logits(hidden[self._put(last)])  # [S, V]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Applies `plan` in the StepPlan order and returns the sampled tokens: the scheduled sequences that
        reached all their known tokens, in batch order, then the fork children, in plan order. Raises
        PlanError on a plan that contradicts the worker's state. (`launch` then `finish`.)"""
        if self.in_flight:
            raise RuntimeError("execute() with steps in flight: finish them first")
        self.launch(plan)
        return self.finish()

    def launch(self, plan: StepPlan) -> None:
        """Applies `plan` and queues its step on the device, behind the step in flight if there is one (at
        most one: finish the older ones first). Raises PlanError on a plan that contradicts the worker's
        state."""
        forwarded = self.launch_forward(plan)
        if forwarded is not None:
            self.launch_sampling(forwarded)

    @torch.inference_mode()
    def launch_forward(self, plan: StepPlan) -> ForwardedStep | None:
        """The first half of `launch`: applies `plan` and queues the model's forward pass. Returns the step
        for `launch_sampling` to queue its sampler, or None when it has none (then it is in flight already).

        The step in flight before it may be finished in between: the sampler's host work then comes after
        that step's answer, off the path from one step's end to the scheduler's next plan."""
        if len(self.in_flight) > 1:
            raise RuntimeError("launch() with two steps in flight: finish the oldest first")
        if verifies_drafts(self.in_flight):  # its accepted drafts move the positions this plan reads
            raise RuntimeError("launch() behind a step that verifies drafts: finish it first")
        mark = self._mark_launch
        mark("start")
        seqs = self.sequences.apply(plan, self.kv)
        self.structured.on_plan(plan)
        num_tokens = plan.num_scheduled_tokens
        if not seqs:
            prepare_drafts(self.spec, plan, seqs, [], self.tables)  # (the proposer frees the freed)
            self._queue(LaunchedStep(plan.step_id, [], [], None, None, None, None))
            return None
        sampling = batch_indices(plan)
        mark("plan")
        spec = prepare_drafts(self.spec, plan, seqs, sampling, self.tables)  # None: no draft slots
        mark("propose")
        batch_seqs, batch_tokens = (spec.input_seqs, spec.num_tokens) if spec else (seqs, num_tokens)
        inputs = host_inputs(self.tables, batch_seqs, batch_tokens, self.block_size)
        feed = self._pending_feed(plan.scheduled_seq_ids, seqs, inputs)
        feed = spec.draft_feed(feed, inputs.query_start_loc, sampling) if spec else feed  # device drafts
        mark("inputs")
        started = ended = None
        if self.device.type == "cuda":
            started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            started.record()
        scores = select_prompt_rows(plan, seqs, inputs.query_start_loc, self._put, self.prompt_scores)
        rows = spec.logits_rows(inputs.query_start_loc, sampling) if spec else None  # drafts: 1 + d each
        if spec is not None:  # verification as decode rows where it can (worker/spec/decode_rows.py)
            inputs = verification_inputs(inputs, num_tokens, spec.num_tokens, scores is not None, self.graphs)
        logits = self._forward(inputs, sampling, feed, scores, rows)
        mark("forward")
        if self.trace_launches:
            self.launch_trace.forward_queued(plan.step_id)
        self.sequences.computed(seqs, num_tokens)
        if logits is None:
            if ended is not None:
                ended.record()
            self._queue(LaunchedStep(plan.step_id, [], [], None, None, started, ended))
            return None
        seq_ids = [plan.scheduled_seq_ids[b] for b in sampling]
        self.forwarded = ForwardedStep(
            plan, seq_ids, [seqs[b] for b in sampling], logits, started, ended, spec
        )
        return self.forwarded

    @torch.inference_mode()
    def launch_sampling(self, step: ForwardedStep) -> None:
        """The second half of `launch`: creates the fork children, queues the sampler and the copy of its
        results, and puts the step in flight."""
        mark = self._mark_launch
        mark("previous_step")  # since the forward: the step before it answered, if it was
        self.forwarded = None
        plan, seq_ids, samplers, logits = step.plan, step.seq_ids, step.samplers, step.logits
        if plan.forks:
            # Each child draws from its parent's logits row (its parent samples: the plan was checked).
            row_of = {seq_id: i for i, seq_id in enumerate(seq_ids)}
            parents = [row_of[fork.parent_seq_id] for fork in plan.forks]
            rows = list(range(len(logits))) + (step.spec.parent_rows(parents) if step.spec else parents)
            logits = logits[self._put(np.array(rows, dtype=np.int64))]
            seq_ids += [fork.child_seq_id for fork in plan.forks]
            samplers += self.sequences.fork(plan)
        # One transfer of every row's parameters, the draws queued on the device, one copy of the results.
        make_tensors = step.spec.sampling_tensors if step.spec is not None else step_sampling_tensors
        sampling_tensors = make_tensors(samplers, self.device, self.logits_processors)
        in_flight = lambda: step_tokens(self.in_flight[-1])  # noqa: E731 (tokens pending in the step before)
        bitmask = self.structured.bitmask(plan.step_id, seq_ids, samplers, in_flight, self.device)
        bitmask = step.spec.expand_bitmask(bitmask) if bitmask and step.spec else bitmask
        sampling_tensors = replace(sampling_tensors, token_bitmask=bitmask) if bitmask else sampling_tensors
        mark("sampling_params")
        if self.trace_launches:
            self.launch_trace.sampler_queuing(plan.step_id, self.structured.last_stats if bitmask else {})
        out = sample_tensors(logits, sampling_tensors)
        copy = out.start_copy()
        mark("sample")
        if step.ended is not None:
            step.ended.record()
        self.sequences.sampled(samplers)
        launched = LaunchedStep(plan.step_id, seq_ids, samplers, out.tokens, copy, step.started, step.ended)
        launched.spec = step.spec
        self._queue(launched)
        self.structured.prefill_after(launched)  # its rows' next masks, once its tokens are on the host

    def draft_ahead(self) -> None:
        """Drafts ahead of the next plan, with nothing in flight, on one rank (worker/spec/ahead.py)."""
        if self.spec is not None and not self.in_flight and self.parallel.world_size == 1:
            self.spec.draft_ahead(self.sequences.seqs)

    def _mark_launch(self, phase: str) -> None:
        if self.trace_launches:
            if phase == "start":
                self.launch_marks = {}
            self.launch_marks[phase] = time.perf_counter()

    def _queue(self, step: LaunchedStep) -> None:
        """Puts a launched step in flight; one with events is timed against the last one before it."""
        if step.ended is not None:
            step.previous_ended = self._last_ended
            self._last_ended = step.ended
        self.in_flight.append(step)

    def finish(self) -> StepOutput:
        """Waits for the oldest step in flight, appends its tokens and returns its output."""
        step = self.in_flight.popleft()
        new_tokens: list[int] = []
        logprobs: list = []
        if step.copy is not None:
            new_tokens, logprobs = step.copy.wait()
        gpu_s = idle_s = 0.0
        if step.ended is not None and step.started is not None:
            step.ended.synchronize()
            gpu_s = self.last_step_gpu_s = step.started.elapsed_time(step.ended) / 1e3
            if step.previous_ended is not None:
                idle_s = max(0.0, step.previous_ended.elapsed_time(step.started) / 1e3)
        if self.trace_launches:
            self.launch_trace.finished(step.step_id, step.started, step.ended)
        accepted = step.spec.accept(new_tokens, logprobs) if step.spec is not None else None
        self.sequences.received(step.samplers, accepted[0] if accepted else new_tokens)
        forwarded = self.forwarded
        if forwarded is not None and not self.in_flight and not forwarded.plan.forks:
            # Its tokens all on the host: the grammars of the step forwarded behind it can advance and fill
            # its masks now, in the background, while this answer goes out (worker/structured.py).
            self.structured.prefetch(forwarded.plan.step_id, forwarded.seq_ids, forwarded.samplers)
        prompt_logprobs = take_prompt_scores(self.prompt_scores, step.step_id)
        out = StepOutput(step.step_id, step.seq_ids, new_tokens, logprobs, gpu_s, idle_s, prompt_logprobs)
        masked = masked_seq_ids(step.seq_ids, step.copy.masked_rows, step.spec) if step.copy else []
        # their constraint failed, or their rows had no token left to draw (worker/masked_rows.py)
        out.failed_seq_ids = list(dict.fromkeys(self.structured.take_failed(step.step_id) + masked))
        out.failed_disk_reads = self.kv.failed_disk_reads(step.step_id)
        if accepted is not None and step.spec is not None:
            step.spec.apply(step.samplers, accepted[1], accepted[2], out, self.tables)
        return out
