"""Packaging: the server's top-level folders go into the wheel under the one `pagedserve` import name.

pyproject.toml holds the metadata; this file only maps the folders, which a static `packages` list cannot do
without naming every subpackage by hand (a new `worker/models/...` package would be silently left out).
Installed, `api`, `client`, `common`, `kernels`, `scheduler` and `worker` are site-packages/pagedserve/NAME,
never top-level names of their own (`kernels` is also a Hugging Face package); pagedserve/__init__.py makes
them importable by their short names inside pagedserve's processes.
"""

from setuptools import find_packages, setup

FOLDERS = ["api", "client", "common", "kernels", "scheduler", "worker"]

subpackages = find_packages(include=[f"{name}*" for name in FOLDERS])
own = find_packages(include=["pagedserve.*"])  # the command's own subpackages (pagedserve/replicas)
setup(
    packages=["pagedserve", *own, *(f"pagedserve.{name}" for name in subpackages)],
    package_dir={"pagedserve": "pagedserve", **{f"pagedserve.{name}": name for name in FOLDERS}},
)
