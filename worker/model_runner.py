"""The worker's state and its one operation: apply a StepPlan, run the batch, sample, answer a StepOutput.

The runner owns the model, the KV pools (worker/kv_cache.py) and, per sequence, the tokens, block table and
computed-token count that the scheduler mirrors. Block ids come from the scheduler, which owns their ref
counts; the runner only reads and writes where they point.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from common.config import WorkerConfig
from common.messages import NewSequence, StepOutput, StepPlan
from worker.attention import AttentionMetadata, get_attention_backend
from worker.kv_cache import KVPools, determine_num_cpu_blocks, determine_num_kv_blocks
from worker.loader import ModelConfig, load_model_config, load_weights
from worker.model import LlamaModel
from worker.sampler import SamplingRow, sample


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
    beam: bool = False  # report candidates, append nothing: the scheduler chooses the beam's tokens

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
            s.beam,
        )


def resolve_max_model_len(cfg: WorkerConfig, model_cfg: ModelConfig) -> int:
    """The configured max_model_len, or the model's own limit; never past the model's limit."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return cfg.max_model_len or limit


class ModelRunner:
    """Runs StepPlans on one device: the model, the KV pools and every live sequence's state."""

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
        num_blocks = determine_num_kv_blocks(
            cfg, self.model_config, self.max_model_len, self.device, self.dtype
        )
        num_cpu_blocks = determine_num_cpu_blocks(cfg, self.model_config, self.dtype)
        self.kv = KVPools(
            self.model_config, num_blocks, num_cpu_blocks, self.block_size, self.dtype, self.device
        )
        self.seqs: dict[int, SeqState] = {}

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
    def eos_token_ids(self) -> list[int]:
        return list(self.model_config.eos_token_ids)

    # -----------------------------------------------------------------------------------------------------
    # Plan application: steps 0 to 4 of the StepPlan order, then the checks of steps 5 and 6

    def _apply_changes(self, plan: StepPlan) -> None:
        for parent_id, child_id in plan.clones:
            if child_id in self.seqs:
                raise PlanError(f"step {plan.step_id}: clone {child_id} already exists")
            parent = self._seq(plan, parent_id)
            self.seqs[child_id] = replace(
                parent, token_ids=list(parent.token_ids), block_table=list(parent.block_table)
            )
        for seq_id, token in plan.appended_tokens:
            if not 0 <= token < self.vocab_size:
                raise PlanError(f"step {plan.step_id}: appended token {token} is outside the vocab")
            self._seq(plan, seq_id).token_ids.append(token)
        for seq_id in plan.freed_seq_ids:
            if self.seqs.pop(seq_id, None) is None:
                raise PlanError(f"step {plan.step_id}: freed sequence {seq_id} is unknown")

        self._check_pairs(plan, "swap_out", plan.swap_out, self.num_kv_blocks, self.num_cpu_blocks)
        self._check_pairs(plan, "swap_in", plan.swap_in, self.num_cpu_blocks, self.num_kv_blocks)
        self.kv.swap_out(plan.swap_out)
        self.kv.swap_in(plan.swap_in)
        for seq_id, table in plan.new_block_tables:
            seq = self._seq(plan, seq_id)
            self._check_blocks(plan, seq_id, table)
            seq.block_table = list(table)

        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise PlanError(f"step {plan.step_id}: new sequence {new.seq_id} already exists")
            if not 0 <= new.num_computed_tokens <= len(new.token_ids):
                raise PlanError(f"step {plan.step_id}: sequence {new.seq_id} has bad num_computed_tokens")
            if new.num_computed_tokens > len(new.block_table) * self.block_size:
                raise PlanError(
                    f"step {plan.step_id}: sequence {new.seq_id} has {new.num_computed_tokens} computed "
                    f"tokens but only {len(new.block_table)} blocks"
                )
            if new.token_ids and not 0 <= min(new.token_ids) <= max(new.token_ids) < self.vocab_size:
                raise PlanError(f"step {plan.step_id}: sequence {new.seq_id} has token ids outside the vocab")
            self._check_blocks(plan, new.seq_id, new.block_table)
            self.seqs[new.seq_id] = SeqState.from_new(new)
        for seq_id, block_ids in plan.new_block_ids:
            seq = self._seq(plan, seq_id)
            self._check_blocks(plan, seq_id, block_ids)
            seq.block_table.extend(block_ids)

        self._check_pairs(plan, "block_copies", plan.block_copies, self.num_kv_blocks, self.num_kv_blocks)
        if {src for src, _ in plan.block_copies} & {dst for _, dst in plan.block_copies}:
            raise PlanError(f"step {plan.step_id}: block_copies writes a block it also reads")
        self.kv.copy(plan.block_copies)

    def _check_pairs(
        self, plan: StepPlan, name: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int
    ) -> None:
        """Source ids inside their pool, destination ids inside theirs and distinct (one write per block)."""
        for src, dst in pairs:
            if not (0 <= src < num_src and 0 <= dst < num_dst):
                raise PlanError(
                    f"step {plan.step_id}: {name} pair ({src}, {dst}) is outside the pools "
                    f"({num_src} source blocks, {num_dst} destination blocks)"
                )
        if len({dst for _, dst in pairs}) != len(pairs):
            raise PlanError(f"step {plan.step_id}: {name} writes a block twice")

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

    def _check_forks(self, plan: StepPlan, sampling_ids: set[int]) -> None:
        """Each fork's parent samples this step, and each child id is new."""
        children = [fork.child_seq_id for fork in plan.forks]
        if len(set(children)) != len(children):
            raise PlanError(f"step {plan.step_id}: a fork child id appears twice")
        for fork in plan.forks:
            if fork.parent_seq_id not in sampling_ids:
                raise PlanError(
                    f"step {plan.step_id}: fork parent {fork.parent_seq_id} does not sample this step"
                )
            if fork.child_seq_id in self.seqs:
                raise PlanError(f"step {plan.step_id}: fork child {fork.child_seq_id} already exists")

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

    def _create_children(self, plan: StepPlan, seq_ids: list[int], samplers: list[SeqState]) -> list[int]:
        """Step 6: each fork's child starts as its parent after the forward (tokens, computed count, a block
        table of the same, shared blocks) with its own seed, and joins `seq_ids` / `samplers`. Returns the
        index of each child's parent among the samplers: the logits row the child draws from."""
        row_of = {seq_id: i for i, seq_id in enumerate(seq_ids)}
        parent_rows = [row_of[fork.parent_seq_id] for fork in plan.forks]
        for fork, row in zip(plan.forks, parent_rows, strict=True):
            parent = samplers[row]
            child = replace(
                parent, token_ids=list(parent.token_ids), block_table=list(parent.block_table), seed=fork.seed
            )
            self.seqs[fork.child_seq_id] = child
            seq_ids.append(fork.child_seq_id)
            samplers.append(child)
        return parent_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Applies `plan` in the StepPlan order and returns the sampled tokens: the scheduled sequences that
        reached all their known tokens, in batch order, then the fork children, in plan order. Raises
        PlanError on a plan that contradicts the worker's state."""
        self._apply_changes(plan)
        seqs = self._check_scheduled(plan)
        num_tokens = list(plan.num_scheduled_tokens)
        sampling = [
            b
            for b, (s, n) in enumerate(zip(seqs, num_tokens, strict=True))
            if s.num_computed_tokens + n == len(s.token_ids)
        ]
        self._check_forks(plan, {plan.scheduled_seq_ids[b] for b in sampling})
        if not seqs:
            return StepOutput(plan.step_id, [], [], [])
        token_ids, positions, meta = self._prepare(seqs, num_tokens)
        hidden = self.model(token_ids, positions, meta, self.kv.layers)  # [T, H]
        for seq, n in zip(seqs, num_tokens, strict=True):
            seq.num_computed_tokens += n
        if not sampling:
            return StepOutput(plan.step_id, [], [], [])

        # The last scheduled token of each sampling sequence is the row that predicts its next token.
        last_rows = meta.query_start_loc[1:].long()[torch.tensor(sampling, device=self.device)] - 1
        logits = self.model.compute_logits(hidden[last_rows])  # [S, V]
        seq_ids = [plan.scheduled_seq_ids[b] for b in sampling]
        samplers = [seqs[b] for b in sampling]
        if plan.forks:
            parent_rows = self._create_children(plan, seq_ids, samplers)
            logits = logits[torch.tensor(list(range(len(sampling))) + parent_rows, device=logits.device)]
        rows = [
            SamplingRow(s.temperature, s.top_k, s.top_p, s.seed, len(s.token_ids), s.num_logprobs)
            for s in samplers
        ]
        new_tokens, logprobs = sample(logits, rows)
        for seq, token in zip(samplers, new_tokens, strict=True):
            if not seq.beam:
                seq.token_ids.append(token)
        return StepOutput(plan.step_id, seq_ids, new_tokens, logprobs)
