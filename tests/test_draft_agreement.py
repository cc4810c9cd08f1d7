"""scripts/draft_agreement.py: greedy verification's accepted lengths, and the whole script on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scripts.draft_agreement import accepted_lengths, main


def test_accepted_lengths_follow_greedy_verification() -> None:
    m = np.array([1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0], dtype=bool)
    # step 1: two accepted, then the target's token (position 2); step 2: four (k), the target's token at
    # 7; step 3: position 8 accepted, the target's at 9; step 4: none at 10
    assert accepted_lengths(m, 4) == [2, 4, 1, 0]
    assert accepted_lengths(np.ones(10, dtype=bool), 4) == [4, 4]
    assert accepted_lengths(np.zeros(3, dtype=bool), 4) == [0, 0, 0]


def test_a_draft_that_is_the_target_has_every_draft_accepted(tiny_model_dir: Path) -> None:
    model = str(tiny_model_dir)
    argv = ["--model", model, "--draft", model, "--device", "cpu", "--num-prompts", "2", "--output-len", "20"]
    report = main([*argv, "--prompt-len", "8"])
    assert report["token_agreement"] == 1.0
    assert report["histogram"] == {"0": 0, "1": 0, "2": 0, "3": 0, "4": 8}  # 20 = 4 steps of 4 + 1 per row
