"""The kernels compiled for Hopper (sm90) on a machine without a GPU, down to the cubin
(`scripts/compile_kernels.py`: Triton's own LLVM and ptxas). The interpreter, which the other kernel tests
run on the CPU, lowers nothing, so a kernel it runs may still fail to compile. Here at head size 96 (padded
to 128 in registers) on the paths the worker launches, beside 128: they compile, and the padding costs no
shared memory beyond the padded size's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOPPER_SHARED_BYTES = 227 * 1024  # per program, opted in
VARIANTS = ["decode-split", "prefill-window-softcap", "combine", "write-kv-fp8"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], dict]:
    out = tmp_path_factory.mktemp("compile") / "kernels.json"
    cmd = [sys.executable, str(ROOT / "scripts/compile_kernels.py"), "--head-dims", "96,128"]
    cmd += ["--variants", ",".join(VARIANTS), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode and "No module named 'triton.backends.nvidia" in done.stderr:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    assert done.returncode == 0, done.stderr[-4000:]
    return {(row["head_dim"], row["variant"]): row for row in json.loads(out.read_text())}


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_size_96_compiles_for_hopper_in_the_shared_memory_of_128(compiled: dict, variant: str) -> None:
    padded, pow2 = compiled[(96, variant)], compiled[(128, variant)]
    assert padded["shared_bytes"] == pow2["shared_bytes"] <= HOPPER_SHARED_BYTES
    assert padded["ptx_sha256"] != pow2["ptx_sha256"]  # the column masks are in the code at 96
