"""A Hugging Face hub cache laid out by hand (nothing can be downloaded in tests): HF_HOME/hub/
models--ORG--NAME/snapshots/COMMIT/ holding a checkpoint's files, refs/BRANCH holding the commit."""

from __future__ import annotations

import shutil
from pathlib import Path


def add_to_hub_cache(
    hf_home: Path, repo_id: str, checkpoint: Path, commit: str = "a" * 40, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Puts `checkpoint`'s files into the cache under HF_HOME `hf_home` as `repo_id` at `commit`, which each
    of `refs` names; returns the snapshot directory."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
