"""pagedserve, installed: `pagedserve serve MODEL` (pagedserve/cli.py).

The server's packages keep their folders at the top of the repository (api/, client/, common/, kernels/,
scheduler/, worker/) and import one another by those names (`from common.config import WorkerConfig`), as
`python -m scheduler` from a checkout needs. Installed, they must not take those generic names in
site-packages (`kernels` is also a Hugging Face package that transformers looks for), so setup.py puts them
inside this package (site-packages/pagedserve/common, ...), and importing this package puts the folder that
holds them on sys.path: only a process that imports pagedserve sees them as top-level names. `CODE_ROOT` is
that folder: this package's own in an installed copy, the checkout's root in a checkout (or an editable
install). Use the top-level names (`import common.config`) after `import pagedserve`, never
`pagedserve.common...`, which would load a second copy of each module.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _code_root() -> Path:
    for root in (_HERE, _HERE.parent):  # installed copy, then checkout
        if (root / "common" / "config.py").is_file():
            return root
    raise ImportError(f"pagedserve: the server's packages are neither in {_HERE} nor in {_HERE.parent}")


CODE_ROOT = _code_root()
if str(CODE_ROOT) not in sys.path:
    sys.path.insert(0, str(CODE_ROOT))
