"""The worker's state and its one operation: apply a StepPlan, run the batch, sample, answer a StepOutput.

The runner owns the model, the KV pool and, per sequence, the tokens, block table and computed-token count
that the scheduler mirrors. Block ids come from the scheduler; the runner only writes where they point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from common.config import WorkerConfig
from common.messages import NewSequence, StepOutput, StepPlan
from worker.attention import AttentionMetadata, get_attention_backend
from worker.loader import ModelConfig, load_model_config, load_weights
from worker.model import KVCache, LlamaModel
from worker.sampler import SamplingRow, sample

MAX_SEQS_FOR_CPU_POOL = 256  # the CPU pool never grows past what this many max-length sequences need
CUDA_MEMORY_FRACTION = 0.9  # of the free memory after loading weights


class PlanError(ValueError):
    """A StepPlan that contradicts the worker's state: a bug in the scheduler."""


@dataclass
class SeqState:
    """The worker's copy of one sequence."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    num_logprobs: int

    @classmethod
    def from_new(cls, s: NewSequence) -> SeqState:
        return cls(
            list(s.token_ids),
            list(s.block_table),
            s.num_computed_tokens,
            s.temperature,
            s.top_p,
            s.top_k,
            s.seed,
            s.num_logprobs,
        )


def resolve_max_model_len(cfg: WorkerConfig, model_cfg: ModelConfig) -> int:
    """The configured max_model_len, or the model's own limit; never past the model's limit."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return cfg.max_model_len or limit


def kv_block_bytes(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model_cfg.num_layers * block_size * model_cfg.kv_size * elem


def determine_num_kv_blocks(
    cfg: WorkerConfig, model_cfg: ModelConfig, max_model_len: int, device: torch.device, dtype: torch.dtype
) -> int:
    """How many KV blocks to allocate: the configured number, else what the memory budget holds.

    CPU: `kv_cache_memory_gib`, or a quarter of the available memory, capped at what MAX_SEQS_FOR_CPU_POOL
    sequences of max_model_len need. CUDA: CUDA_MEMORY_FRACTION of the free memory (call after loading).
    """
    if cfg.num_kv_blocks > 0:
        return cfg.num_kv_blocks
    per_block = kv_block_bytes(model_cfg, cfg.block_size, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, int(free * CUDA_MEMORY_FRACTION) // per_block)
    if cfg.kv_cache_memory_gib > 0:
        budget = int(cfg.kv_cache_memory_gib * (1 << 30))
    else:
        budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    cap = MAX_SEQS_FOR_CPU_POOL * -(-max_model_len // cfg.block_size)
    return max(1, min(budget // per_block, cap))


class ModelRunner:
    """Runs StepPlans on one device: the model, the paged KV pool and every live sequence's state."""

    def __init__(self, cfg: WorkerConfig, attention_backend: str = "torch") -> None:
        self.device = torch.device(cfg.resolved_device)
        self.dtype: torch.dtype = getattr(torch, cfg.resolved_dtype)
        self.block_size = cfg.block_size
        self.model_config = load_model_config(cfg.model)
        self.max_model_len = resolve_max_model_len(cfg, self.model_config)
        backend = get_attention_backend(attention_backend)
        self.model = LlamaModel(self.model_config, self.max_model_len, backend, self.dtype, self.device)
        load_weights(self.model, self.model_config, cfg.model)
        self.model.eval()
        self.num_kv_blocks = determine_num_kv_blocks(
            cfg, self.model_config, self.max_model_len, self.device, self.dtype
        )
        c = self.model_config
        shape = (2, self.num_kv_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        # Zeroed, not empty: attention reads whole blocks and masks the unused tail, and a NaN there would
        # survive the zero weight.
        pools = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(c.num_layers)]
        self.kv_caches: list[KVCache] = [(p[0], p[1]) for p in pools]
        self.seqs: dict[int, SeqState] = {}

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.model_config.eos_token_ids)

    # -----------------------------------------------------------------------------------------------------
    # Plan application

    def _apply_changes(self, plan: StepPlan) -> None:
        for seq_id in plan.freed_seq_ids:
            if self.seqs.pop(seq_id, None) is None:
                raise PlanError(f"step {plan.step_id}: freed sequence {seq_id} is unknown")
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise PlanError(f"step {plan.step_id}: new sequence {new.seq_id} already exists")
            if not 0 <= new.num_computed_tokens <= len(new.token_ids):
                raise PlanError(f"step {plan.step_id}: sequence {new.seq_id} has bad num_computed_tokens")
            if new.token_ids and not 0 <= min(new.token_ids) <= max(new.token_ids) < self.vocab_size:
                raise PlanError(f"step {plan.step_id}: sequence {new.seq_id} has token ids outside the vocab")
            self._check_blocks(plan, new.seq_id, new.block_table)
            self.seqs[new.seq_id] = SeqState.from_new(new)
        for seq_id, block_ids in plan.new_block_ids:
            seq = self._seq(plan, seq_id)
            self._check_blocks(plan, seq_id, block_ids)
            seq.block_table.extend(block_ids)

    def _check_blocks(self, plan: StepPlan, seq_id: int, block_ids: list[int]) -> None:
        if block_ids and not 0 <= min(block_ids) <= max(block_ids) < self.num_kv_blocks:
            raise PlanError(f"step {plan.step_id}: sequence {seq_id} got block ids outside the KV pool")

    def _seq(self, plan: StepPlan, seq_id: int) -> SeqState:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise PlanError(f"step {plan.step_id}: sequence {seq_id} is unknown")
        return seq

    def _check_scheduled(self, plan: StepPlan) -> list[SeqState]:
        if len(plan.scheduled_seq_ids) != len(plan.num_scheduled_tokens):
            raise PlanError(f"step {plan.step_id}: scheduled_seq_ids and num_scheduled_tokens lengths differ")
        if len(set(plan.scheduled_seq_ids)) != len(plan.scheduled_seq_ids):
            raise PlanError(f"step {plan.step_id}: a sequence is scheduled twice")
        seqs = []
        for seq_id, n in zip(plan.scheduled_seq_ids, plan.num_scheduled_tokens, strict=True):
            seq = self._seq(plan, seq_id)
            end = seq.num_computed_tokens + n
            if n < 1 or end > len(seq.token_ids):
                raise PlanError(
                    f"step {plan.step_id}: sequence {seq_id} scheduled {n} tokens from "
                    f"{seq.num_computed_tokens} but knows {len(seq.token_ids)}"
                )
            if end > self.max_model_len:
                raise PlanError(f"step {plan.step_id}: sequence {seq_id} reaches {end} > max_model_len")
            if len(seq.block_table) * self.block_size < end:
                raise PlanError(
                    f"step {plan.step_id}: sequence {seq_id} needs {end} slots but its block table has "
                    f"{len(seq.block_table)} blocks of {self.block_size}"
                )
            seqs.append(seq)
        return seqs

    # -----------------------------------------------------------------------------------------------------
    # The step

    def _prepare(
        self, seqs: list[SeqState], num_tokens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat token ids [T], positions [T] and attention metadata for the batch, built on the host."""
        bs = self.block_size
        starts = [s.num_computed_tokens for s in seqs]
        seq_lens = [c + n for c, n in zip(starts, num_tokens, strict=True)]
        token_ids: list[int] = []
        for seq, c, end in zip(seqs, starts, seq_lens, strict=True):
            token_ids.extend(seq.token_ids[c:end])

        max_blocks = -(-max(seq_lens) // bs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for b, (seq, end) in enumerate(zip(seqs, seq_lens, strict=True)):
            used = -(-end // bs)
            tables[b, :used] = seq.block_table[:used]
        block_tables = torch.from_numpy(tables)  # [B, max_blocks]

        q_lens = torch.tensor(num_tokens)  # [B]
        query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)  # [B + 1]
        torch.cumsum(q_lens, 0, out=query_start_loc[1:])
        seq_index = torch.repeat_interleave(torch.arange(len(seqs)), q_lens)  # [T]
        # Token j of sequence b sits at position start_b + (j - query_start_loc_b).
        offsets = torch.tensor(starts) - query_start_loc[:-1].long()  # [B]
        positions = torch.arange(len(token_ids)) + offsets[seq_index]  # [T]
        blocks = block_tables[seq_index, positions // bs].long()  # [T]
        slot_mapping = blocks * bs + positions % bs  # [T]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev, non_blocking=True),
            block_tables=block_tables.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=query_start_loc.to(dev, non_blocking=True),
            max_query_len=max(num_tokens),
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(token_ids).to(dev, non_blocking=True), positions.to(dev, non_blocking=True), meta

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Applies `plan` (see StepPlan) and returns the tokens sampled by the sequences that finished their
        known tokens, in scheduled order. Raises PlanError on a plan that contradicts the worker's state."""
        self._apply_changes(plan)
        seqs = self._check_scheduled(plan)
        if not seqs:
            return StepOutput(plan.step_id, [], [], [])
        num_tokens = list(plan.num_scheduled_tokens)
        token_ids, positions, meta = self._prepare(seqs, num_tokens)
        hidden = self.model(token_ids, positions, meta, self.kv_caches)  # [T, H]

        for seq, n in zip(seqs, num_tokens, strict=True):
            seq.num_computed_tokens += n
        sampling = [b for b, s in enumerate(seqs) if s.num_computed_tokens == len(s.token_ids)]
        if not sampling:
            return StepOutput(plan.step_id, [], [], [])
        # The last scheduled token of each sampling sequence is the row that predicts its next token.
        last_rows = meta.query_start_loc[1:].long()[torch.tensor(sampling, device=self.device)] - 1
        logits = self.model.compute_logits(hidden[last_rows])  # [S, V]
        rows = [
            SamplingRow(s.temperature, s.top_k, s.top_p, s.seed, len(s.token_ids), s.num_logprobs)
            for s in (seqs[b] for b in sampling)
        ]
        new_tokens, logprobs = sample(logits, rows)
        for b, token in zip(sampling, new_tokens, strict=True):
            seqs[b].token_ids.append(token)
        seq_ids = [plan.scheduled_seq_ids[b] for b in sampling]
        return StepOutput(plan.step_id, seq_ids, new_tokens, logprobs)
