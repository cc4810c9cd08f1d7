"""scripts/train_synthetic.py: the synthetic language, and a (very short) training run that check_correctness
then draws its prompts from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from scripts.check_correctness import main as check_correctness
from scripts.train_synthetic import LANGUAGE_FILE, SyntheticLanguage
from scripts.train_synthetic import main as train


def test_sentences_follow_the_rule_nine_times_in_ten_and_avoid_special_tokens() -> None:
    language = SyntheticLanguage.make(vocab_size=5000, special={0, 1, 2}, seed=3, size=64)
    assert len(set(language.token_ids)) == 64 and not {0, 1, 2} & set(language.token_ids)
    ids = language.sample(np.random.default_rng(0), 64, 200)
    assert ids.shape == (64, 200) and set(np.unique(ids)) <= set(language.token_ids)
    follows = (ids[:, 2:] == language.likely_next(ids)).mean()
    assert 0.88 < follows < 0.92  # 0.9 by the rule, plus 1/64 of the noise that lands on it anyway
    # the rule needs the token before the current one: the two halves' successor tables differ
    assert language.succ[0] != language.succ[1]


def test_training_writes_the_language_and_check_correctness_uses_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).save_pretrained(model)
    report = train(["--model", str(model), "--device", "cpu", "--steps", "3", "--batch-size", "2"])
    assert AutoConfig.from_pretrained(model).dtype == torch.bfloat16  # trained in float32, saved as it was
    assert AutoModelForCausalLM.from_pretrained(model).dtype == torch.bfloat16
    saved = json.loads((model / LANGUAGE_FILE).read_text())
    assert saved == report and saved["train"]["steps"] == 3
    assert 0.0 <= saved["train"]["greedy_rule_accuracy"] <= 1.0 and np.isfinite(saved["train"]["final_loss"])
    language = SyntheticLanguage.load(model)
    assert language is not None and language.token_ids == saved["token_ids"]

    argv = ["--model", str(model), "--device", "cpu", "--num-prompts", "3", "--max-tokens", "6"]
    result = check_correctness([*argv, "--max-prompt-len", "24"])
    assert result["prompts"].startswith("synthetic language")
    assert result["identical"] == 3  # float32 on both sides, still
