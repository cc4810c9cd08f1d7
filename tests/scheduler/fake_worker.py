"""A worker without a model, for scheduler tests: it follows plans exactly as the real worker does.

It writes (position, token, hash of the tokens before it) -- what a real KV entry depends on -- into a slot
array through each sequence's block table, runs swaps and copy-on-write copies on that array, and before
"sampling" reads back every slot of the sequence's context: a block written by two sequences with different
content, a table that lost a block, a wrong prefix-cache hit, a missed copy or swap fails at once. Its next
token depends only on the sequence's seed and its tokens so far, as a seeded model's would.

With a sliding window W (every layer windowed) a query at position p reads positions p - W + 1 .. p only: the
check reads just those, so a block the scheduler freed too early (and gave to another sequence) fails, and
the table entries of holes (sent as a valid null id) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedserve.common.messages import StepOutput, StepPlan, TokenLogprobs


def fake_next_token(seed: int, token_ids: list[int], vocab_size: int) -> int:
    return hash((seed, len(token_ids), token_ids[-1], token_ids[len(token_ids) // 2])) % vocab_size


def fake_drafts(seed: int, token_ids: list[int], k: int, vocab_size: int) -> list[int]:
    """A proposer right about 60% of the time (and proposing nothing now and then), deterministic."""
    drafts: list[int] = []
    for _ in range(hash((seed, len(token_ids), "k")) % (k + 1)):
        token = fake_next_token(seed, token_ids + drafts, vocab_size)
        right = hash((seed, len(token_ids) + len(drafts), "right")) % 10 < 6
        drafts.append(token if right else (token + 1) % vocab_size)
    return drafts


def fake_candidates(token_ids: list[int], k: int, vocab_size: int) -> tuple[list[int], list[float]]:
    """A beam's k best next tokens and their logprobs: distinct tokens, strictly falling logprobs, no ties."""
    h = hash(tuple(token_ids))
    tokens: list[int] = []
    while len(tokens) < k:
        token = hash((h, len(tokens), "token")) % vocab_size
        if token not in tokens:
            tokens.append(token)
    logprobs = [-(0.05 + 0.5 * i + (hash((h, i)) % 1000) / 4000) for i in range(k)]
    return tokens, logprobs


@dataclass
class _SeqState:
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    seed: int
    num_logprobs: int
    beam: bool = False


class FakeWorker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        num_cpu_blocks: int = 0,
        sliding_window: int = 0,
    ) -> None:
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.vocab_size = vocab_size
        # A slot holds (position, token, the token ids before it): what a real KV entry depends on.
        self.slots: list[tuple | None] = [None] * (num_blocks * block_size)
        self.cpu_slots: list[tuple | None] = [None] * (num_cpu_blocks * block_size)
        self.seqs: dict[int, _SeqState] = {}
        self.plans: list[StepPlan] = []

    def _slot(self, state: _SeqState, position: int) -> int:
        return state.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _copy_blocks(self, src_pool: list, dst_pool: list, pairs: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in pairs:
            dst_pool[dst * bs : (dst + 1) * bs] = src_pool[src * bs : (src + 1) * bs]

    def execute(self, plan: StepPlan) -> StepOutput:
        self.plans.append(plan)
        for parent_id, child_id in plan.clones:
            assert child_id not in self.seqs
            parent = self.seqs[parent_id]
            self.seqs[child_id] = replace(
                parent, token_ids=list(parent.token_ids), block_table=list(parent.block_table)
            )
        for seq_id, token in plan.appended_tokens:
            self.seqs[seq_id].token_ids.append(token)
        for seq_id in plan.freed_seq_ids:
            del self.seqs[seq_id]
        self._copy_blocks(self.slots, self.cpu_slots, plan.swap_out)
        self._copy_blocks(self.cpu_slots, self.slots, plan.swap_in)
        for seq_id, table in plan.new_block_tables:
            self.seqs[seq_id].block_table = list(table)
        for new in plan.new_seqs:
            assert new.seq_id not in self.seqs, f"seq {new.seq_id} sent twice"
            self.seqs[new.seq_id] = _SeqState(
                list(new.token_ids), list(new.block_table), new.num_computed_tokens, new.seed,
                new.params.num_logprobs, new.params.beam,
            )  # fmt: skip
        for seq_id, blocks in plan.new_block_ids:
            self.seqs[seq_id].block_table.extend(blocks)
        self._copy_blocks(self.slots, self.slots, plan.block_copies)
        for new in plan.new_seqs:  # a prefix-cache hit must hold exactly this sequence's KV
            c = new.num_computed_tokens
            self._check_context(new.seq_id, self.seqs[new.seq_id], c, self._window_start(c))
        out = StepOutput(plan.step_id, [], [], [])
        forked: list[tuple[int, _SeqState]] = []
        draft_slots = dict(plan.draft_slots)
        assert len(draft_slots) == len(plan.draft_slots), "draft slots twice"
        runs: dict[int, tuple[int, int]] = {}  # seq id -> (tokens emitted, drafts verified)
        sampling = set(plan.sampling_seq_ids)
        assert sampling <= set(plan.scheduled_seq_ids), "a sampling sequence is not scheduled"
        for seq_id, num_tokens in zip(plan.scheduled_seq_ids, plan.num_scheduled_tokens, strict=True):
            state = self.seqs[seq_id]
            assert num_tokens >= 1
            end = state.num_computed_tokens + num_tokens
            first = self._window_start(state.num_computed_tokens)  # what this step's first query reads
            assert end <= len(state.token_ids), "scheduled past the known tokens"
            assert len(state.block_table) * self.block_size >= end, "block table too short"
            for pos in range(state.num_computed_tokens, end):
                self.slots[self._slot(state, pos)] = self._kv(state, pos)
            state.num_computed_tokens = end
            self._check_context(seq_id, state, end, first)  # attention reads the context through the table
            samples = seq_id in sampling
            assert not samples or end == len(state.token_ids), "sampling before the last known token"
            k = draft_slots.get(seq_id, 0)
            if k:
                assert samples and num_tokens == 1 and not state.beam, (
                    "draft slots for a sequence that cannot"
                )
                runs[seq_id] = self._verify(seq_id, state, k, out)
            elif samples:
                self._sample(seq_id, state, out)
            for fork in (f for f in plan.forks if f.parent_seq_id == seq_id):
                assert samples, "a fork's parent must sample in the same step"
                child = _SeqState(
                    list(state.token_ids[:end]), list(state.block_table), end, fork.seed, state.num_logprobs
                )
                self.seqs[fork.child_seq_id] = child
                forked.append((fork.child_seq_id, child))
        for child_id, child in forked:
            self._sample(child_id, child, out)
        if draft_slots:
            out.num_tokens = [runs.get(s, (1, 0))[0] for s in out.seq_ids]
            out.num_drafts = [runs.get(s, (1, 0))[1] for s in out.seq_ids]
        return out

    def _verify(self, seq_id: int, state: _SeqState, k: int, out: StepOutput) -> tuple[int, int]:
        """Speculative decoding as the real worker does it: the drafts' KV written into the slots the plan
        allocated, the target's token drawn at each position, drafts accepted while they equal it, the
        accepted drafts' KV counted as computed and the blocks past it dropped from the table."""
        end = state.num_computed_tokens
        drafts = fake_drafts(state.seed, state.token_ids, k, self.vocab_size)
        assert len(state.block_table) * self.block_size >= end + k, "no slots for the drafts"
        extended = _SeqState(state.token_ids + drafts, state.block_table, end, state.seed, state.num_logprobs)
        for pos in range(end, end + len(drafts)):
            self.slots[self._slot(state, pos)] = self._kv(extended, pos)
        emitted: list[int] = []
        for j in range(len(drafts) + 1):
            emitted.append(fake_next_token(state.seed, state.token_ids + emitted, self.vocab_size))
            if j == len(drafts) or emitted[-1] != drafts[j]:
                break
        state.token_ids += emitted
        state.num_computed_tokens = end + len(emitted) - 1
        del state.block_table[-(-state.num_computed_tokens // self.block_size) :]
        out.seq_ids.append(seq_id)
        out.token_ids += emitted
        lp = None
        if state.num_logprobs >= 0:
            lp = TokenLogprobs(-1.0, list(range(state.num_logprobs)), [-1.0] * state.num_logprobs)
        out.logprobs += [lp] * len(emitted)
        return len(emitted), len(drafts)

    @staticmethod
    def _kv(state: _SeqState, pos: int) -> tuple:
        return (pos, state.token_ids[pos], hash(tuple(state.token_ids[:pos])))

    def _window_start(self, position: int) -> int:
        """The first position a query at `position` reads."""
        return max(0, position - self.sliding_window + 1) if self.sliding_window else 0

    def _check_context(self, seq_id: int, state: _SeqState, num_tokens: int, first: int = 0) -> None:
        for pos in range(first, num_tokens):
            held = self.slots[self._slot(state, pos)]
            assert held == self._kv(state, pos), f"seq {seq_id} position {pos}: KV slot holds {held}"

    def _sample(self, seq_id: int, state: _SeqState, out: StepOutput) -> None:
        if state.beam:  # report candidates; the scheduler appends the chosen token
            tokens, logprobs = fake_candidates(state.token_ids, state.num_logprobs, self.vocab_size)
            out.seq_ids.append(seq_id)
            out.token_ids.append(tokens[0])
            out.logprobs.append(TokenLogprobs(logprobs[0], tokens, logprobs))
            return
        token = fake_next_token(state.seed, state.token_ids, self.vocab_size)
        state.token_ids.append(token)
        out.seq_ids.append(seq_id)
        out.token_ids.append(token)
        lp = None
        if state.num_logprobs >= 0:
            lp = TokenLogprobs(-1.0, list(range(state.num_logprobs)), [-1.0] * state.num_logprobs)
        out.logprobs.append(lp)
