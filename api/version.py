"""GET /version: {"version": ...}, the pagedserve release this api runs, as vLLM's /version answers."""

from __future__ import annotations

import functools
import importlib.metadata
import tomllib
from pathlib import Path

from aiohttp import web

PACKAGE = "pagedserve"
# In a checkout the api runs from the repository (`python -m pagedserve.api`), whose pyproject.toml names
# the version; installed, api/ sits in site-packages/pagedserve/ and the version is the distribution's
# metadata.
CHECKOUT_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@functools.cache
def server_version() -> str:
    """The version of the code that runs: the checkout's pyproject.toml when there is one (an older
    installed copy must not answer for it), else the installed distribution's; "unknown" when neither."""
    try:
        with CHECKOUT_PYPROJECT.open("rb") as f:
            project = tomllib.load(f).get("project", {})
        if project.get("name") == PACKAGE and isinstance(project.get("version"), str):
            return project["version"]
    except (OSError, tomllib.TOMLDecodeError):
        pass
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": server_version()})
