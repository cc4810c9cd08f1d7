"""Where a `--model` lives: a local checkpoint directory, or a Hugging Face repo id resolved through
`huggingface_hub` to a snapshot directory of its cache.

The one place that turns a model setting into a directory, for the worker (WorkerConfig.model), the api
(ApiConfig.model, whose tokenizer it loads) and `pagedserve serve`: common/config.py calls `resolve_config`
when it parses a config that has a `revision` field. A repo id goes through `snapshot_download`, so the
Hub's own settings hold: its cache (`HF_HOME`, `HF_HUB_CACHE`), offline mode (`HF_HUB_OFFLINE=1`: the cache
only, a branch or tag read from its `refs/`), the token (`HF_TOKEN` or `hf auth login`). Only what the
server reads is fetched (config, tokenizer, safetensors; no safetensors for a worker with --load-format
dummy), not the `.bin`/`.pth` copies many repos carry.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

# What the worker (config.json, *.safetensors and their index, generation_config.json) and the tokenizer
# (tokenizer.json / .model, vocab and merges, chat_template.jinja) read
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
# The Hub's rule for a repo id: `name` or `namespace/name`, letters, digits, `-`, `_`, `.`
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")

C = TypeVar("C")


class ModelSourceError(ValueError):
    """The model setting names nothing that can be served; the message is one line for the operator."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: the directory to load, and the name clients know it by."""

    path: str  # a local directory holding config.json
    name: str  # the repo id for a Hub model; the directory's name for a local one
    repo_id: str = ""  # empty for a local directory
    revision: str = ""  # the commit the snapshot is of (Hub models)


def is_repo_id(model: str) -> bool:
    """Whether `model` has the form of a Hub repo id (it may still be a local path that does not exist)."""
    return bool(_REPO_ID.match(model)) and ".." not in model and not model.endswith(".")


def resolve_model(model: str, revision: str = "", strict: bool = True, weights: bool = True) -> ModelSource:
    """The checkpoint directory for `model`. Raises ModelSourceError, with one line saying why, when it is
    a repo id that neither the cache holds nor the Hub gives; and, if `strict`, when it is a directory
    without config.json or neither a directory nor a repo id. Not `strict`, those pass through unchanged, for
    the process to report as it always has (the api stays up and says "misconfigured" on /health).
    Without `weights` (the worker's --load-format dummy), a repo's *.safetensors are not fetched."""
    path = Path(model).expanduser()
    if path.is_dir():
        if revision:
            raise ModelSourceError(
                f"--revision {revision!r} is for a Hugging Face repo id; {model!r} is a local directory"
            )
        if strict and not (path / "config.json").is_file():
            raise ModelSourceError(f"model directory {model!r} has no config.json")
        return ModelSource(str(path), path.resolve().name)
    if not is_repo_id(model):
        if strict:
            raise ModelSourceError(f"model {model!r}: no such directory, and not a Hugging Face repo id")
        return ModelSource(model, path.name)
    snapshot = _download(model, revision, weights)
    if not (Path(snapshot) / "config.json").is_file():
        raise ModelSourceError(f"model {model!r}: the snapshot in the Hugging Face cache has no config.json")
    return ModelSource(snapshot, model, model, Path(snapshot).name)


def _download(repo_id: str, revision: str, weights: bool = True) -> str:
    # Imported here: a local directory, the common case in tests and scripts, needs none of it.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        return snapshot_download(
            repo_id,
            revision=revision or None,
            allow_patterns=ALLOW_PATTERNS if weights else [p for p in ALLOW_PATTERNS if p != "*.safetensors"],
            # said outright: offline, a commit hash as revision would still ask the Hub for its file list
            local_files_only=constants.HF_HUB_OFFLINE,
        )
    except LocalEntryNotFoundError:
        how = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else "the Hugging Face Hub could not be reached"
        )
        raise ModelSourceError(
            f"model {repo_id!r}{at}: no such directory, not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and {how}"
        ) from None
    except GatedRepoError:
        raise ModelSourceError(
            f"model {repo_id!r}: a gated repo; accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"model {repo_id!r}: no revision {revision!r} on the Hub") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(
            f"model {repo_id!r}: no such directory, and no such repo on the Hub (private? set HF_TOKEN)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelSourceError(f"model {repo_id!r}{at}: download failed: {first_line}") from None


def resolve_config(config: C, strict: bool = False) -> C:
    """`config` (a dataclass with `model`, `revision` and `served_model_name` fields) with `model` made a
    local directory and `revision` emptied (it is in the snapshot's path), and a Hub model served under its
    repo id unless another name is set. An empty `model` (the api's: learn it from the worker) stays so."""
    model: str = getattr(config, "model")  # noqa: B009
    if not model:
        return config
    weights = getattr(config, "load_format", "auto") != "dummy"  # a worker drawing its weights reads none
    source = resolve_model(model, getattr(config, "revision"), strict, weights)  # noqa: B009
    changes: dict[str, Any] = {"model": source.path, "revision": ""}
    if source.repo_id and not getattr(config, "served_model_name"):  # noqa: B009
        changes["served_model_name"] = source.repo_id
    return dataclasses.replace(config, **changes)  # type: ignore[type-var]
