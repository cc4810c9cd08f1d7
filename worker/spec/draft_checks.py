"""Whether a checkpoint can draft for a target: the draft model proposer's refusals, each naming its reason.

A draft proposes token ids that the target verifies, so the two must mean the same text by the same id:
- vocabulary: the draft's logits cover at most the target's ids (a smaller vocabulary is fine: the target
  can take every id the draft proposes; a larger one could propose ids the target has no row for);
- tokenizer: where the draft checkpoint has one, it must map every token to the same id as the target's.
  `tokenizer.json` (a fast tokenizer: its vocabulary and added tokens, read with the `tokenizers` library)
  is compared where both have it, else `tokenizer.model` (a SentencePiece model) byte for byte; a draft
  whose tokenizer is of a kind the target's is not cannot be compared and is refused. A draft checkpoint
  without tokenizer files is taken on its vocabulary size alone (a common way to ship a draft).
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.worker.model_config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


class UnusableDraftError(ValueError):
    """A draft checkpoint that cannot draft for the target; the message says why."""


def check_draft(
    draft_dir: str | Path, draft: ModelConfig, target_dir: str | Path, target: ModelConfig
) -> None:
    """Raises UnusableDraftError when the checkpoint in `draft_dir` cannot draft for the one in
    `target_dir`."""
    if draft.vocab_size > target.vocab_size:
        raise UnusableDraftError(
            f"draft model {draft_dir} has a vocabulary of {draft.vocab_size} ids, more than the target's "
            f"{target.vocab_size}: it could propose ids the target cannot verify"
        )
    check_same_tokenizer(Path(draft_dir), Path(target_dir))


def check_same_tokenizer(draft_dir: Path, target_dir: Path) -> None:
    """Raises UnusableDraftError when the draft's tokenizer (if it has one) differs from the target's."""
    draft_files = [name for name in TOKENIZER_FILES if (draft_dir / name).is_file()]
    if not draft_files:
        return
    for name in draft_files:
        if (target_dir / name).is_file():
            _compare(name, draft_dir / name, target_dir / name)
            return
    raise UnusableDraftError(
        f"draft model {draft_dir} has a tokenizer ({', '.join(draft_files)}) that cannot be compared with "
        f"the target's (none of those files in {target_dir}): a draft must use the target's tokenizer"
    )


def _compare(name: str, draft_path: Path, target_path: Path) -> None:
    if name == "tokenizer.model":
        if draft_path.read_bytes() != target_path.read_bytes():
            raise UnusableDraftError(
                f"draft model's tokenizer.model differs from the target's ({target_path}): a draft must use "
                f"the target's tokenizer"
            )
        return
    from tokenizers import Tokenizer

    draft_vocab = Tokenizer.from_file(str(draft_path)).get_vocab(with_added_tokens=True)
    target_vocab = Tokenizer.from_file(str(target_path)).get_vocab(with_added_tokens=True)
    for token, token_id in sorted(draft_vocab.items(), key=lambda item: item[1]):
        if target_vocab.get(token) != token_id:
            where = target_vocab.get(token)
            theirs = "has no such token" if where is None else f"has it at id {where}"
            raise UnusableDraftError(
                f"draft model's tokenizer differs from the target's: the draft's token {token!r} is id "
                f"{token_id}, the target {theirs}; a draft must use the target's tokenizer"
            )
    # Every draft token is the target's at the same id: the target has more (added tokens), which the
    # draft never proposes.
