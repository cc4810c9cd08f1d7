"""The product packages have no import loops and no oversized files (scripts/check_imports.py)."""

from __future__ import annotations

from pathlib import Path

from scripts.check_imports import MAX_LINES, find_cycles, import_graph, oversized_files


def test_product_packages_have_no_import_cycles() -> None:
    assert find_cycles(import_graph()) == []


def test_no_product_file_exceeds_the_line_limit() -> None:
    assert oversized_files() == {}, f"over {MAX_LINES} lines"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_deferred_or_type_checking_import_still_closes_a_cycle(tmp_path: Path) -> None:
    root = _write(
        tmp_path,
        {
            "worker/__init__.py": "",
            "worker/a.py": "def f():\n    from worker.b import g\n",
            "worker/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker import a\n",
            "worker/c.py": "from . import a\n",  # one way: no cycle
            "kernels/__init__.py": "",
        },
    )
    assert find_cycles(import_graph(root)) == [("worker.a", "worker.b")]


def test_a_package_importing_its_own_modules_is_not_a_cycle(tmp_path: Path) -> None:
    root = _write(
        tmp_path, {"api/__init__.py": "from api.app import make_app\n", "api/app.py": "import api.x\n"}
    )
    _write(root, {"api/x.py": "X = 1\n"})
    assert find_cycles(import_graph(root)) == []


def test_oversized_files_are_counted_in_lines(tmp_path: Path) -> None:
    root = _write(tmp_path, {"common/big.py": "x = 1\n" * 11, "common/small.py": "x = 1\n" * 10})
    assert oversized_files(root, limit=10) == {"common/big.py": 11}
