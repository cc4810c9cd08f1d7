"""A worker without a model, for scheduler tests: it follows plans exactly as the real worker does.

It writes (seq_id, position, token) into a slot array through each sequence's block table and, before
"sampling", reads back every slot of the sequence's context: a block handed to two live sequences, a table
that lost a block, or a token computed twice in the wrong place fails at once. Its next token depends only
on the sequence's seed and its tokens so far, as a seeded model's would.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.messages import StepOutput, StepPlan, TokenLogprobs


def fake_next_token(seed: int, token_ids: list[int], vocab_size: int) -> int:
    return hash((seed, len(token_ids), token_ids[-1], token_ids[len(token_ids) // 2])) % vocab_size


@dataclass
class _SeqState:
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    seed: int
    num_logprobs: int


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.slots: list[tuple[int, int, int] | None] = [None] * (num_blocks * block_size)
        self.seqs: dict[int, _SeqState] = {}
        self.plans: list[StepPlan] = []

    def _slot(self, state: _SeqState, position: int) -> int:
        return state.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        for seq_id in plan.freed_seq_ids:
            del self.seqs[seq_id]
        for new in plan.new_seqs:
            assert new.seq_id not in self.seqs, f"seq {new.seq_id} sent twice"
            self.seqs[new.seq_id] = _SeqState(
                list(new.token_ids),
                list(new.block_table),
                new.num_computed_tokens,
                new.seed,
                new.num_logprobs,
            )
        for seq_id, blocks in plan.new_block_ids:
            self.seqs[seq_id].block_table.extend(blocks)
        out = StepOutput(plan.step_id, [], [], [])
        for seq_id, num_tokens in zip(plan.scheduled_seq_ids, plan.num_scheduled_tokens, strict=True):
            state = self.seqs[seq_id]
            assert num_tokens >= 1
            end = state.num_computed_tokens + num_tokens
            assert end <= len(state.token_ids), "scheduled past the known tokens"
            assert len(state.block_table) * self.block_size >= end, "block table too short"
            for pos in range(state.num_computed_tokens, end):
                self.slots[self._slot(state, pos)] = (seq_id, pos, state.token_ids[pos])
            state.num_computed_tokens = end
            for pos in range(end):  # attention reads the whole context through the block table
                assert self.slots[self._slot(state, pos)] == (seq_id, pos, state.token_ids[pos]), (
                    f"seq {seq_id} position {pos}: KV slot holds {self.slots[self._slot(state, pos)]}"
                )
            if end == len(state.token_ids):
                token = fake_next_token(state.seed, state.token_ids, self.vocab_size)
                state.token_ids.append(token)
                out.seq_ids.append(seq_id)
                out.token_ids.append(token)
                lp = None
                if state.num_logprobs >= 0:
                    lp = TokenLogprobs(-1.0, list(range(state.num_logprobs)), [-1.0] * state.num_logprobs)
                out.logprobs.append(lp)
        return out
