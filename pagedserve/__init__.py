"""pagedserve: the one import name of the server's packages.

The packages keep their folders at the top of the repository (api/, client/, common/, kernels/, scheduler/,
worker/), and every import names them through this package: `from pagedserve.common.config import
WorkerConfig`, `python -m pagedserve.scheduler`. Installed, setup.py puts the folders inside this package
(site-packages/pagedserve/common, ...), so the environment gains no generic top-level names (`common`,
`client`, `kernels`, which is also a Hugging Face package) and a user's own modules of those names are never
shadowed. In a checkout (or an editable install) the folders sit beside this one, and this package's search
path takes in the repository's root, so `pagedserve.common` is <root>/common there. `CODE_ROOT` is the folder
that holds them either way; `IMPORT_ROOT` is the folder a process needs on its path to import pagedserve.
"""

from __future__ import annotations

from pathlib import Path

FOLDERS = ("api", "client", "common", "kernels", "scheduler", "worker")
_HERE = Path(__file__).resolve().parent


def _code_root() -> Path:
    for root in (_HERE, _HERE.parent):  # installed copy, then checkout
        if (root / "common" / "config.py").is_file():
            return root
    raise ImportError(f"pagedserve: the server's packages are neither in {_HERE} nor in {_HERE.parent}")


CODE_ROOT = _code_root()
IMPORT_ROOT = _HERE.parent
if CODE_ROOT != _HERE and str(CODE_ROOT) not in __path__:
    __path__.append(str(CODE_ROOT))  # a checkout: pagedserve.common is <root>/common
