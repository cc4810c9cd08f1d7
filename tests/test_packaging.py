"""What an install declares: every package the server imports at run time is one of pyproject's dependencies
(else `pip install .` gives a server that dies on import, as it did without jsonschema and xgrammar),
constraints.txt pins each of them, requirements.txt agrees with it, and the licence is declared and shipped.
The install itself, in a fresh environment, is tests/e2e/test_pagedserve_serve.py."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("api", "client", "common", "kernels", "scheduler", "worker", "pagedserve")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def declared() -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in pyproject()["project"]["dependencies"]}


def pins(path: Path) -> dict[str, str]:
    """NAME==VERSION lines of a requirements or constraints file, by canonical name."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            req = Requirement(line)
            found[canonicalize_name(req.name)] = str(req.specifier).removeprefix("==")
    return found


def third_party_imports() -> dict[str, set[str]]:
    """Top-level names imported by the product's modules (at any depth) that are neither the standard
    library's nor the product's own, each with the files that import it."""
    found: dict[str, set[str]] = {}
    for pkg in PRODUCT:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "pagedserve":
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_a_declared_dependency() -> None:
    distributions = packages_distributions()
    missing = {}
    for module, files in third_party_imports().items():
        names = {canonicalize_name(d) for d in distributions.get(module, [module])}
        if not names & declared():
            missing[module] = sorted(files)
    assert missing == {}, "imported at run time but not in pyproject's dependencies"


def test_the_checker_sees_the_imports_that_were_missing() -> None:
    """jsonschema (api/tools.py) and xgrammar (worker/structured.py and others) were the undeclared two."""
    imports = third_party_imports()
    assert "api/tools.py" in imports["jsonschema"] and "xgrammar" in imports


def test_constraints_pin_every_dependency_and_requirements_agree() -> None:
    constraints = pins(ROOT / "constraints.txt")
    assert declared() - set(constraints) == set()
    for name, version in pins(ROOT / "requirements.txt").items():
        assert constraints.get(name, version) == version, name
    assert "-c constraints.txt" in (ROOT / "requirements.txt").read_text().splitlines()


def test_the_licence_is_declared_and_shipped() -> None:
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
