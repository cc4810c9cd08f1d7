"""The draft model proposer (worker/spec/draft_model.py) against the draft checkpoint's own greedy
continuation from transformers (`generate`), as the sequences' tokens grow by accepted drafts, shrink
(rejections, recomputes) or are new; its block pool; its refusals of unusable drafts."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.speculative import SpeculativeConfig
from pagedserve.worker.kv_cache import determine_num_kv_blocks
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.spec.draft_checks import UnusableDraftError
from pagedserve.worker.spec.draft_model import DraftModelProposer
from pagedserve.worker.spec.proposer import ProposeRow
from scripts.make_model import make_model

K = 4
BLOCK_SIZE = 4  # small blocks: drafts and rollbacks cross block boundaries


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two drafts for the tiny Llama target, both with its tokenizer: a smaller Llama and a Qwen2."""
    root = tmp_path_factory.mktemp("drafts")
    return {
        "tiny-draft": make_model(root / "tiny-draft", preset="tiny-draft", seed=1),
        "qwen2-tiny": make_model(root / "qwen2-tiny", preset="qwen2-tiny", seed=2),
    }


def _proposer(
    target: Path, draft: Path, num_blocks: int = 0, max_prefill_tokens: int = 0, **cfg: object
) -> DraftModelProposer:
    worker = WorkerConfig(
        model=str(target), device="cpu", dtype="float32", block_size=BLOCK_SIZE, max_model_len=256,
        max_num_seqs=8, swap_space=0, **cfg,  # type: ignore[arg-type]
    )  # fmt: skip
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=K, model=str(draft))
    proposer = DraftModelProposer(worker, spec, "cpu", torch.float32, max_prefill_tokens=max_prefill_tokens)
    if num_blocks:
        proposer.allocate_kv(num_blocks)
    return proposer


class Reference:
    """The draft checkpoint in transformers: greedy continuations by `generate`, no EOS stop."""

    def __init__(self, draft: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.model.generation_config.pad_token_id = 0

    @torch.inference_mode()
    def greedy(self, token_ids: list[int], n: int) -> list[int]:
        ids = torch.tensor([token_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        return out[0, len(token_ids) :].tolist()


def _check(proposer: DraftModelProposer, ref: Reference, seqs: dict[int, list[int]], nums: dict[int, int]):
    rows = [ProposeRow(seq_id, tokens, nums.get(seq_id, K)) for seq_id, tokens in seqs.items()]
    drafts = proposer.propose(rows)
    assert proposer.pool is not None
    proposer.pool.check_invariants()
    for row, draft in zip(rows, drafts, strict=True):
        assert draft == ref.greedy(list(row.token_ids), min(row.num_tokens, K)), row.seq_id
    return dict(zip(seqs, drafts, strict=True))


@pytest.mark.parametrize("draft_name", ["tiny-draft", "qwen2-tiny"])
def test_drafts_are_the_draft_models_greedy_continuation_as_sequences_grow_shrink_and_join(
    tiny_model_dir: Path, draft_dirs: dict[str, Path], draft_name: str
) -> None:
    draft = draft_dirs[draft_name]
    proposer, ref = _proposer(tiny_model_dir, draft, num_blocks=256), Reference(draft)
    rng = random.Random(0)
    seqs = {
        seq_id: [rng.randrange(4096) for _ in range(n)] for seq_id, n in [(1, 1), (2, 5), (3, 17), (4, 30)]
    }
    nums = {2: 2}  # fewer drafts asked for one row
    for step in range(6):
        drafts = _check(proposer, ref, seqs, nums)
        for seq_id, tokens in seqs.items():
            accepted = rng.randrange(len(drafts[seq_id]) + 1)
            rejected = drafts[seq_id][accepted] if accepted < len(drafts[seq_id]) else -1
            bonus = rng.choice([t for t in range(4096) if t != rejected][:50])  # the target's own token
            tokens += drafts[seq_id][:accepted] + [bonus]
        if step == 2:  # a recompute that lost the last tokens, and a rollback past the accepted ones
            del seqs[3][-6:]
            del seqs[4][-2:]
        if step == 3:  # a new sequence joins, one leaves
            seqs[5] = [rng.randrange(4096) for _ in range(9)]
            proposer.free(1)
            del seqs[1]
    for seq_id in list(seqs):
        proposer.free(seq_id)
    proposer.pool.check_invariants()
    assert proposer.pool.num_free_blocks == 256 and not proposer.pool.seqs


def test_a_long_prompt_catches_up_in_chunks_without_holding_back_the_others(
    tiny_model_dir: Path, draft_dirs: dict[str, Path]
) -> None:
    draft = draft_dirs["tiny-draft"]
    proposer, ref = _proposer(tiny_model_dir, draft, num_blocks=64, max_prefill_tokens=24), Reference(draft)
    long, short = list(range(100, 160)), [7, 8, 9]
    calls = 0
    while True:
        calls += 1
        drafts = proposer.propose([ProposeRow(1, long, K), ProposeRow(2, short, K)])
        proposer.pool.check_invariants()
        assert drafts[1] == ref.greedy(short, K)  # the short row drafts every call
        if drafts[0]:
            assert drafts[0] == ref.greedy(long, K)
            break
        assert calls < 10
    assert calls == 3  # 60 tokens at 24 a call, less the short row's first 3 (its later 1 a call is free)


def test_a_full_pool_proposes_nothing_for_rows_that_do_not_fit_and_fails_nothing(
    tiny_model_dir: Path, draft_dirs: dict[str, Path]
) -> None:
    draft = draft_dirs["tiny-draft"]
    proposer, ref = _proposer(tiny_model_dir, draft, num_blocks=6), Reference(draft)  # 24 tokens
    a, b = list(range(10, 22)), list(range(30, 45))  # 12 + 4 and 15 + 4 tokens of KV with their drafts
    drafts = proposer.propose([ProposeRow(1, a, K), ProposeRow(2, b, K)])
    assert drafts[0] == ref.greedy(a, K) and drafts[1] == []
    proposer.pool.check_invariants()
    proposer.free(1)
    assert proposer.propose([ProposeRow(2, b, K)]) == [ref.greedy(b, K)]
    proposer.free(2)
    assert proposer.pool.num_free_blocks == 6
    # Longer than the whole pool: never drafts, never fails.
    assert proposer.propose([ProposeRow(3, list(range(40)), K)]) == [[]]
    proposer.pool.check_invariants()


def test_rows_that_cannot_draft_get_nothing(tiny_model_dir: Path, draft_dirs: dict[str, Path]) -> None:
    proposer = _proposer(tiny_model_dir, draft_dirs["tiny-draft"], num_blocks=128)
    at_limit = list(range(256))  # max_model_len: no position for a draft
    drafts = proposer.propose([ProposeRow(1, at_limit, K), ProposeRow(2, [5, 6], 0), ProposeRow(3, [], K)])
    assert drafts == [[], [], []]
    near_limit = list(range(254))
    assert len(proposer.propose([ProposeRow(4, near_limit, K)])[0]) == 2
    assert proposer.propose([]) == []


def test_the_target_budget_leaves_room_for_a_draft_pool_of_as_many_blocks(tiny_model_dir: Path) -> None:
    cfg = WorkerConfig(model=str(tiny_model_dir), device="cpu", kv_cache_memory_gib=0.01, block_size=16)
    target = load_model_config(tiny_model_dir)
    alone = determine_num_kv_blocks(cfg, target, 2048, torch.device("cpu"), torch.float32)
    per_block = 2 * target.num_layers * 16 * target.kv_size * 4
    shared = determine_num_kv_blocks(cfg, target, 2048, torch.device("cpu"), torch.float32, 0, per_block)
    assert shared == alone // 2


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unusable_drafts_are_refused_with_the_reason(
    tiny_model_dir: Path, draft_dirs: dict[str, Path], tmp_path: Path
) -> None:
    draft = draft_dirs["tiny-draft"]
    big = _copy(draft, tmp_path / "big-vocab")
    config = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**config, "vocab_size": 5000}))
    with pytest.raises(UnusableDraftError, match="vocabulary of 5000 ids, more than the target's 4096"):
        _proposer(tiny_model_dir, big)

    other = _copy(draft, tmp_path / "other-tokenizer")
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    said = f"the draft's token {second!r} is id {vocab[second]}, the target has it at id {vocab[first]}"
    with pytest.raises(UnusableDraftError, match=re.escape(said)):
        _proposer(tiny_model_dir, other)

    sentencepiece = _copy(draft, tmp_path / "sentencepiece")
    (sentencepiece / "tokenizer.json").unlink()
    (sentencepiece / "tokenizer.model").write_bytes(b"not the target's")
    with pytest.raises(UnusableDraftError, match="cannot be compared"):
        _proposer(tiny_model_dir, sentencepiece)

    bare = _copy(draft, tmp_path / "no-tokenizer")  # nothing to compare: taken on its vocabulary size
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    assert _proposer(tiny_model_dir, bare, num_blocks=8).propose([ProposeRow(1, [1, 2, 3], 2)])[0]


def test_the_triton_backend_drafts_what_the_torch_reference_drafts(
    tiny_model_dir: Path, draft_dirs: dict[str, Path]
) -> None:
    # On the CPU under TRITON_INTERPRET=1 (the suite's setting); eager, as on CUDA with --enforce-eager.
    draft = draft_dirs["tiny-draft"]
    torch_ref = _proposer(tiny_model_dir, draft, num_blocks=64)
    triton = _proposer(tiny_model_dir, draft, num_blocks=64, attention_backend="triton")
    seqs = {1: list(range(200, 209)), 2: [3], 3: list(range(40, 62))}
    for _ in range(2):
        rows = [ProposeRow(seq_id, tokens, K) for seq_id, tokens in seqs.items()]
        drafts = triton.propose(rows)
        assert drafts == torch_ref.propose(rows)
        for tokens, draft_tokens in zip(seqs.values(), drafts, strict=True):
            tokens += draft_tokens[:2] + [11]


def test_after_the_first_call_every_forward_is_a_decode_step_whatever_the_target_accepts(
    tiny_model_dir: Path, draft_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every draft's KV is written, so a sequence lacks only the target's own token: the step that catches
    # up is a decode step, which CUDA replays from a graph.
    proposer = _proposer(tiny_model_dir, draft_dirs["tiny-draft"], num_blocks=64)
    query_lens: list[int] = []
    run = proposer._run
    monkeypatch.setattr(
        proposer, "_run", lambda inputs, *a: query_lens.append(inputs.max_query_len) or run(inputs, *a)
    )
    seqs = {1: list(range(300, 310)), 2: list(range(20, 27))}
    for accepted in (K, 0, 2, K, 1):
        rows = [ProposeRow(seq_id, tokens, K) for seq_id, tokens in seqs.items()]
        for tokens, drafts in zip(seqs.values(), proposer.propose(rows), strict=True):
            tokens += drafts[:accepted] + [9]
    assert query_lens[0] == 10 and set(query_lens[1:]) == {1}
    assert len(query_lens) == 5 * (K + 1)  # the first forward, k - 1 drafting steps, one writing KV
