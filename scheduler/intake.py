"""A request's sequences made and queued (moved out of scheduler/scheduler.py, which calls it)."""

from __future__ import annotations

import random

from pagedserve.scheduler.beam import BeamGroup
from pagedserve.scheduler.preemption import PreemptionPolicy
from pagedserve.scheduler.request import Request, SeqStatus, Sequence, SequenceTable
from pagedserve.scheduler.settings import SchedulerSettings
from pagedserve.scheduler.waiting import WaitingQueue

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) over distinct seeds


def queue_request(
    request: Request,
    settings: SchedulerSettings,
    eos_ids: frozenset[int],
    seqs: SequenceTable,
    preemption: PreemptionPolicy,
    waiting: WaitingQueue,
) -> None:
    """Makes the request's sequences (n samples, or the first beam) and queues them: the first waits, the
    other samples wait as fork children of the first (paged policies), sharing its prompt list."""
    params = request.params
    prompt = request.prompt_token_ids
    eos = frozenset() if params.ignore_eos else eos_ids
    request.stop_ids = frozenset(params.stop_token_ids) | eos
    request.max_total_len = min(len(prompt) + params.max_tokens, settings.max_model_len)
    base_seed = params.seed if params.seed is not None else random.getrandbits(63)
    if params.beam_width:
        request.beam = BeamGroup(params.beam_width, params.length_penalty)
    for index in range(1 if request.beam else params.n):
        seed = (base_seed * _SEED_MIX + index) % (1 << 63) if index else base_seed % (1 << 63)
        seq_id = seqs.new_seq_id()
        if index == 0:
            request.order = seq_id
        # a fork child shares the request's prompt list until it is forked (it gets its own list then)
        shared = index > 0 and not settings.reserved
        tokens = prompt if shared else list(prompt)
        sort_key = preemption.sort_key(request, seq_id)
        seq = Sequence(seq_id, request, index, seed, tokens, sort_key=sort_key)
        request.seqs.append(seq)
        if request.beam:
            request.live_beams.append(seq)
        seqs.add(seq)
        if not shared:  # reserved mode shares nothing, as pre-paging servers
            waiting.push(seq)
        else:
            seq.status = SeqStatus.FORK_PENDING
            request.seqs[0].fork_children.append(seq)
