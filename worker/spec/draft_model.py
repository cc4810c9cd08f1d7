"""The draft model proposer: a small checkpoint with the target's tokenizer drafts each sequence's next
tokens greedily, from its own paged KV pool in the target's worker.

How the engine builds it (the worker's speculative factory, `method == "draft_model"`):

    proposer = DraftModelProposer(worker_config, spec_config, device, dtype)  # loads, checks the draft
    # CUDA, before the target's memory profile: the draft's weights are allocated now, so the profile's
    # peak (torch's max_memory_allocated) counts them and `cuda_kv_budget` leaves them out of the KV budget.
    num_blocks = determine_num_kv_blocks(..., extra_block_bytes=proposer.kv_block_bytes)
    proposer.allocate_kv(num_blocks)  # the draft's pool: as many blocks as the target's
    ...
    drafts = proposer.propose(rows)  # each step, for the sequences that speculate
    proposer.free(seq_id)  # finished, aborted, preempted, swapped out

The pool-size rule: the draft's pool holds as many tokens as the target's (it drafts only for sequences
the target holds, and a sequence needs in the draft's pool at most the slots it has in the target's), so
the KV budget is split between the two pools in proportion to their bytes per block: `extra_block_bytes`
makes worker/kv_cache.py size the target's pool by (target + draft) bytes per block. An engine that skips
`allocate_kv` gets, at the first `propose`, a pool of `--num-kv-blocks` blocks where that is set, else
enough for max_num_seqs sequences of max_model_len within DEFAULT_POOL_FRACTION of the device's memory
(on CUDA at most half of what is free then, out of the headroom that --gpu-memory-utilization leaves: a
fallback, not the way to run).

Tensor parallelism: the draft runs whole and replicated on every rank (it is small: its weights and pool
are a few percent of a rank's memory). Every rank runs the same program on the same token ids with the
same weights on the same kind of GPU, so every rank drafts the same tokens, with no collective on the
step's path and the same memory on each rank (the group's pools take the smallest size; rank 0 alone
holding a draft would shrink them all).

A `propose` call: per row, the draft's KV is compared with the row's tokens (the truth) and cut back to
their common prefix (rejected drafts, recomputes); the tokens it lacks are computed in one batched forward
whose total is bounded by `max_prefill_tokens` (a row that cannot catch up in this call computes a chunk
and proposes nothing yet, so one long prompt never stalls a step); each row that caught up gets its first
draft from that forward's last logits row, then greedy decode steps batched over the rows (CUDA graphs on
CUDA, worker/cuda_graphs.py `DecodeGraphs`, for batches up to MAX_GRAPH_BATCH): k - 1 that draft, and one
more that writes the last draft's KV (`DecodeGraphs.replay`: no LM head). That step costs a little, but with
every draft's KV written the next call lacks one token whatever the target accepted (the target's own
token after the accepted drafts), so its first forward is a decode step too and replays a graph; else a
sequence whose drafts were all accepted would lack two tokens, and the happy path would run eagerly. The
drafts' KV stays written: the next call keeps what the target accepted. In that steady state (every planned
row lacks one token and drafts, at most k = num_speculative_tokens and some row k, within the graphs'
sizes) the 1 + k steps replay as one CUDA graph instead (worker/spec/draft_graphs.py `DraftChain`;
`num_chain_replays`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.common.model_source import resolve_model
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.worker.attention import AttentionMetadata, get_attention_backend
from pagedserve.worker.batch_limits import profile_max_num_seqs, resolve_max_num_seqs
from pagedserve.worker.cuda_graphs import DecodeGraphs
from pagedserve.worker.dummy_weights import init_dummy_weights
from pagedserve.worker.inputs import HostInputs, build_inputs
from pagedserve.worker.kv_cache import KVPools, determine_num_kv_blocks, kv_block_bytes
from pagedserve.worker.loader import load_model_config, load_weights
from pagedserve.worker.model_config import resolve_max_model_len
from pagedserve.worker.models.registry import build_model
from pagedserve.worker.parallel import ParallelContext
from pagedserve.worker.spec.device_drafts import DeviceDrafts
from pagedserve.worker.spec.draft_checks import check_draft
from pagedserve.worker.spec.draft_graphs import DraftChain
from pagedserve.worker.spec.draft_pool import DraftBlockPool, DraftSeq
from pagedserve.worker.spec.proposer import ProposeRow
from pagedserve.worker.staging import stage

MAX_GRAPH_BATCH = 64  # decode graphs up to this batch: speculation backs off well before it at high load
DEFAULT_POOL_FRACTION = 0.05  # of the device's memory, for a pool that `allocate_kv` did not size


@dataclass
class _Planned:
    """A row that computes in this call."""

    index: int  # its row of the call
    seq: DraftSeq
    token_ids: list[int]  # the tokens it computes in the first forward
    start: int  # the position of the first
    num_drafts: int  # 0: catching up only
    length: int  # the row's token count (the first draft's position)


class DraftModelProposer:
    """Drafts up to `num_speculative_tokens` greedy tokens per sequence with a small model (module doc)."""

    def __init__(
        self,
        worker_config: WorkerConfig,
        spec_config: SpeculativeConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        max_prefill_tokens: int = 0,  # per call; 0: the target's max_num_batched_tokens
    ) -> None:
        self.cfg = worker_config
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = worker_config.block_size
        self.max_prefill_tokens = max_prefill_tokens or worker_config.max_num_batched_tokens
        dummy = worker_config.load_format == "dummy"  # the draft's weights are drawn too, as vLLM's
        draft_dir = resolve_model(spec_config.model, weights=not dummy).path
        target_config = load_model_config(worker_config.model)
        self.model_config = load_model_config(draft_dir)
        check_draft(draft_dir, self.model_config, worker_config.model, target_config)
        # Drafts never pass the target's length, nor the positions the draft's RoPE covers.
        target_len = resolve_max_model_len(worker_config, target_config)
        self.max_model_len = min(target_len, self.model_config.max_position_embeddings)
        self.backend = get_attention_backend(worker_config.resolved_attention_backend)
        whole = ParallelContext()  # replicated on every tensor-parallel rank (module doc)
        self.model = build_model(
            self.model_config, self.max_model_len, self.backend, dtype, self.device, whole,
            fused_ops=worker_config.resolved_fused_ops,
        )  # fmt: skip
        if dummy:
            init_dummy_weights(self.model, self.model_config, worker_config.seed, whole)
        else:
            load_weights(self.model, self.model_config, draft_dir, whole)
        self.model.eval()
        self.kv: KVPools | None = None
        self.pool: DraftBlockPool | None = None
        self.graphs: DecodeGraphs | None = None
        self.num_kv_only_replays = 0  # graph replays of a last step that only writes the drafts' KV
        # Steady-state calls as one graph replay each (worker/spec/draft_graphs.py), with the decode graphs
        self.chain: DraftChain | None = None
        self.num_chain_replays = 0  # calls that ran the chain (its last step counts as a KV-only replay too)
        # The last call's drafts, whose ids its sequences' records lack until they are on the host:
        # (drafts, [(seq_id, seq, first draft's index in seq.computed, row of the call)])
        self._unsettled: tuple[DeviceDrafts, list[tuple[int, DraftSeq, int, int]]] | None = None

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block of the draft's pool takes (all layers, K and V)."""
        return kv_block_bytes(self.model_config, self.block_size, self.dtype)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    def default_num_blocks(self) -> int:
        """The pool's size when `allocate_kv` was not called (module doc)."""
        if self.cfg.num_kv_blocks > 0:
            return self.cfg.num_kv_blocks
        wanted = profile_max_num_seqs(self.cfg.max_num_seqs) * self.max_blocks_per_seq
        if self.device.type == "cuda":  # and never more than half of what is free now
            free, total = torch.cuda.mem_get_info(self.device)
            budget = min(int(total * DEFAULT_POOL_FRACTION), free // 2)
            return max(1, min(wanted, budget // self.kv_block_bytes))
        cpu = determine_num_kv_blocks(
            self.cfg, self.model_config, self.max_model_len, self.device, self.dtype
        )
        return max(1, min(wanted, cpu))

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocates the draft's pool of `num_blocks` blocks and, on CUDA unless --enforce-eager, captures
        its decode graphs. Once."""
        if self.kv is not None:
            raise RuntimeError("the draft's KV pool is allocated already")
        if num_blocks < 1:
            raise ValueError(f"the draft's KV pool needs at least one block, got {num_blocks}")
        self.kv = KVPools(self.model_config, num_blocks, 0, self.block_size, self.dtype, self.device)
        self.pool = DraftBlockPool(num_blocks, self.block_size, self.max_blocks_per_seq)
        if self.device.type == "cuda" and not self.cfg.enforce_eager and self.backend.graph_safe:
            sizes = {
                # (the target's seats; 0, the default, follows its pool, whose size the draft's mirrors)
                "max_num_seqs": min(
                    resolve_max_num_seqs(self.cfg.max_num_seqs, num_blocks, self.block_size), MAX_GRAPH_BATCH
                ),
                "max_blocks_per_seq": self.max_blocks_per_seq,
                "max_model_len": self.max_model_len,
                "device": self.device,
                "show_progress": False,
            }
            self.graphs = DecodeGraphs(self.model, self.kv.layers, **sizes)  # type: ignore[arg-type]
            self.chain = DraftChain(self.graphs, self.block_size, self.num_speculative_tokens)

    def free(self, seq_id: int) -> None:
        """Returns the sequence's blocks; unknown ids are ignored."""
        if self.pool is not None:
            self.pool.free(seq_id)

    def drop_drafts(self, seq_ids: list[int]) -> None:
        """Gives back the blocks that only the last call's drafts hold, for sequences whose drafts went unused
        (drafts made ahead that the plan did not take: worker/spec/ahead.py), keeping their tokens' KV."""
        self._settle()  # (their record first: it is cut back with the blocks)
        for seq_id in seq_ids:
            seq = self.pool.seqs.get(seq_id) if self.pool is not None else None
            if seq is not None:
                self.pool.truncate(seq, seq.num_truth)  # type: ignore[union-attr]

    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> list[list[int]]:
        """Each row's greedy drafts (at most its num_tokens, at most num_speculative_tokens); none for a row
        still catching up, one the pool has no blocks for, one at max_model_len, or one whose tokens the
        draft's vocabulary lacks. (`propose_on_device`, then a wait for the drafts.)"""
        drafts = self.propose_on_device(rows).host()
        self._settle()
        return drafts

    @torch.inference_mode()
    def propose_on_device(self, rows: list[ProposeRow]) -> DeviceDrafts:
        """`propose`'s drafts left on the device (worker/spec/device_drafts.py): their counts are known now,
        their ids come to the host behind the draft's work, without a wait here. The draft's own record of
        them is completed at the next call."""
        self._settle()
        empty = torch.zeros((len(rows), 0), dtype=torch.int64, device=self.device)
        if not rows:
            return DeviceDrafts([], empty)
        if self.pool is None:
            self.allocate_kv(self.default_num_blocks())
        planned = self._plan(rows)
        counts = [0] * len(rows)
        # Drafting rows, most drafts first: the decode steps run on a shrinking prefix of them.
        drafting = sorted((p for p in planned if p.num_drafts), key=lambda p: -p.num_drafts)
        table = self._chain(len(rows), planned)  # [R, k] the whole call in one replay, in the steady state
        first = None
        if planned and table is None:
            first = self._first_forward(planned, drafting)  # [D] each drafting row's first
        for p in planned:
            p.seq.computed += p.token_ids
            p.seq.num_truth = len(p.seq.computed)
        if not drafting:
            return DeviceDrafts(counts, empty)
        if table is None:
            assert first is not None
            tokens = self._decode(drafting, first)  # [D, max drafts], on the device
            index = stage([np.array([p.index for p in drafting], dtype=np.int64)], self.device)[0]
            table = torch.zeros((len(rows), tokens.shape[1]), dtype=torch.int64, device=self.device)
            table[index] = tokens
        for p in drafting:
            counts[p.index] = p.num_drafts
        drafts = DeviceDrafts(counts, table).start_copy()
        unsettled = []
        for p in drafting:  # their ids are known once the copy is in: `_settle`
            unsettled.append((rows[p.index].seq_id, p.seq, len(p.seq.computed), p.index))
            p.seq.computed += [-1] * p.num_drafts  # (no token id: compares unequal to every truth)
        self._unsettled = (drafts, unsettled)
        return drafts

    def _settle(self) -> None:
        """Writes the last call's drafts, now on the host, into their sequences' records (the KV the draft
        computed for them), for the sequences still in the pool."""
        if self._unsettled is None:
            return
        drafts, unsettled = self._unsettled
        self._unsettled = None
        lists = drafts.host()
        assert self.pool is not None
        for seq_id, seq, start, row in unsettled:
            if self.pool.seqs.get(seq_id) is seq:
                seq.computed[start : start + len(lists[row])] = lists[row]

    # -----------------------------------------------------------------------------------------------------

    def _plan(self, rows: list[ProposeRow]) -> list[_Planned]:
        """Syncs each row's KV with its tokens and picks what it computes now: rows that need fewest tokens
        first, within the prefill budget and the free blocks."""
        assert self.pool is not None
        pool = self.pool
        wanted: list[tuple[int, int, DraftSeq, int]] = []  # (missing, index, seq, num_drafts)
        seen: set[int] = set()
        for i, row in enumerate(rows):
            length = len(row.token_ids)
            num_drafts = min(row.num_tokens, self.num_speculative_tokens, self.max_model_len - length)
            if num_drafts < 1 or length < 1 or row.seq_id in seen:
                continue
            seen.add(row.seq_id)
            seq = pool.get(row.seq_id)
            kept = min(_common_prefix(seq, row.token_ids), length - 1)  # the last token gives the logits
            pool.truncate(seq, kept)
            seq.num_truth = kept
            wanted.append((length - kept, i, seq, num_drafts))
        budget = self.max_prefill_tokens
        planned: list[_Planned] = []
        for missing, i, seq, num_drafts in sorted(wanted, key=lambda w: w[0]):
            token_ids = rows[i].token_ids
            start = len(seq.computed)
            # A row lacking one token (the steady state) always computes it: the budget bounds catch-ups.
            chunk = 1 if missing == 1 else min(missing, budget)
            if chunk < 1:
                break
            new = list(token_ids[start : start + chunk])
            if max(new) >= self.model_config.vocab_size:
                continue  # an id the draft has no embedding for (a target with a larger vocabulary)
            num_drafts = num_drafts if chunk == missing else 0
            if not self.pool.grow(seq, start + chunk + num_drafts):  # KV of the chunk, then the drafts
                continue
            budget -= chunk if missing > 1 else 0
            planned.append(_Planned(i, seq, new, start, num_drafts, len(token_ids)))
        planned.sort(key=lambda p: len(p.token_ids) != 1)  # decodes first, as the target's plans
        return planned

    def _run(self, inputs: HostInputs, feed: torch.Tensor | None, rows: np.ndarray) -> torch.Tensor:
        """Logits [len(rows), V] at the batch's flat token indices `rows`; `feed` [B] (on the device) replaces
        the token ids of a decode batch. The host arrays go over in one pinned buffer (worker/staging.py)."""
        assert self.kv is not None
        batch = len(inputs.seq_lens)
        if self.graphs is not None and inputs.decode_only and self.graphs.padded_size(batch):
            index = torch.arange(batch, device=self.device)
            fed = None if feed is None else (index, feed)
            if not len(rows):  # the KV is all this step is for: no LM head
                self.num_kv_only_replays += 1
                self.graphs.replay(inputs, fed)
                return torch.empty((0, self.model_config.vocab_size), dtype=self.dtype, device=self.device)
            if len(rows) == batch and (rows == np.arange(batch)).all():  # (rows in another order: picked)
                return self.graphs.run(inputs, fed)  # [B, V]
            return self.graphs.run(inputs, fed, stage([rows], self.device)[0])
        arrays = [inputs.token_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables]
        token_ids, positions, slots, tables, lens, starts, picked = stage(
            [*arrays, inputs.seq_lens, inputs.query_start_loc, rows], self.device
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=lens,
            query_start_loc=starts,
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            num_decode_seqs=inputs.num_decode_seqs,
        )
        token_ids = feed if feed is not None else token_ids
        hidden = self.model(token_ids, positions, meta, self.kv.layers)  # [T, H]
        return self.model.compute_logits(hidden[picked])

    def _chain(self, num_rows: int, planned: list[_Planned]) -> torch.Tensor | None:
        """The call's drafts [num_rows, k] from one run of the draft chain (worker/spec/draft_graphs.py) when
        the call is in the steady state: every planned row computes the one token it lacks and drafts, the
        most drafts are k, and a chain holds the rows. None otherwise: the step-by-step path runs."""
        chain = self.chain
        if chain is None or chain.padded_size(len(planned)) is None:
            return None
        num_drafts = np.array([p.num_drafts for p in planned], dtype=np.int64)
        if num_drafts.max() != chain.num_drafts or any(len(p.token_ids) != 1 for p in planned):
            return None
        assert self.pool is not None
        lengths = np.array([p.length for p in planned], dtype=np.int64)
        width = -(-int((lengths + num_drafts).max()) // self.block_size)  # through each row's last draft
        table = chain.run(
            np.array([p.token_ids[0] for p in planned], dtype=np.int64),
            lengths,
            num_drafts,
            self.pool.tables.tables[np.array([p.seq.row for p in planned], dtype=np.int64), :width],
            np.array([p.index for p in planned], dtype=np.int64),
            num_rows,
        )
        self.num_chain_replays += 1
        if chain.captured:  # its last step is the step-by-step path's KV-only replay
            self.num_kv_only_replays += 1
        return table

    def _first_forward(self, planned: list[_Planned], drafting: list[_Planned]) -> torch.Tensor:
        """Computes every planned row's tokens; returns the first drafts [D] of `drafting` (planned rows, in
        that order) on the device."""
        assert self.pool is not None
        num_tokens = np.array([len(p.token_ids) for p in planned], dtype=np.int64)
        inputs = build_inputs(
            self.pool.tables,
            np.array([p.seq.row for p in planned], dtype=np.int64),
            np.array([p.start for p in planned], dtype=np.int64),
            num_tokens,
            np.array([t for p in planned for t in p.token_ids], dtype=np.int64),
            self.block_size,
        )
        batch_index = {id(p): b for b, p in enumerate(planned)}
        last_rows = inputs.query_start_loc[1:].astype(np.int64) - 1
        last = last_rows[np.array([batch_index[id(p)] for p in drafting], dtype=np.int64)]
        if not drafting:
            self._run(inputs, None, last)  # catching up only: the KV is what counts
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self._run(inputs, None, last).argmax(-1)

    def _decode(self, drafting: list[_Planned], first: torch.Tensor) -> torch.Tensor:
        """The drafts [D, max num_drafts] on the device: `first`, then greedy decode steps, each over the rows
        that still draft or still lack their last draft's KV (a prefix of `drafting`, whose num_drafts only
        fall)."""
        assert self.pool is not None
        most = drafting[0].num_drafts
        tokens = torch.zeros((len(drafting), most + 1), dtype=torch.int64, device=self.device)
        tokens[:, 0] = first
        rows = np.array([p.seq.row for p in drafting], dtype=np.int64)
        lengths = np.array([p.length for p in drafting], dtype=np.int64)
        num_drafts = np.array([p.num_drafts for p in drafting], dtype=np.int64)
        for j in range(1, most + 1):
            batch = int((num_drafts >= j).sum())  # rows whose draft j (at position length + j - 1) exists
            inputs = build_inputs(
                self.pool.tables,
                rows[:batch],
                lengths[:batch] + j - 1,
                np.ones(batch, dtype=np.int64),
                np.zeros(batch, dtype=np.int64),
                self.block_size,
            )
            wanted = np.arange(int((num_drafts > j).sum()), dtype=np.int64)  # rows that draft j + 1
            logits = self._run(inputs, tokens[:batch, j - 1].clone(), wanted)
            if len(wanted):
                tokens[: len(wanted), j] = logits.argmax(-1)
        return tokens[:, :most]


def _common_prefix(seq: DraftSeq, truth: object) -> int:
    """How many leading tokens of `seq.computed` equal the sequence's tokens `truth` (a Sequence[int]).

    The tokens that were the truth at the last call (`num_truth`) only grow while the sequence lives, so
    only what the draft proposed past them is compared, unless the truth shrank below them or its last
    such token changed (then everything is)."""
    computed = seq.computed
    truth_len = len(truth)  # type: ignore[arg-type]
    same = seq.num_truth
    if same > truth_len or (same and truth[same - 1] != computed[same - 1]):  # type: ignore[index]
        same = 0
    limit = min(len(computed), truth_len)
    if computed[same:limit] == list(truth[same:limit]):  # type: ignore[index]
        return limit
    while computed[same] == truth[same]:  # type: ignore[index]
        same += 1
    return same
