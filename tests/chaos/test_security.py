"""The cluster key file (common/security.py): made once, private, refused when open to others or malformed,
and an unusable key is a configuration error (exit code 2, which the supervisor does not restart).

Defect guarded: anyone who could reach the worker port became the worker, and anyone could submit.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagedserve.common.security import ClusterKey, ClusterKeyError, load_cluster_key
from scripts._servers import ROOT


def test_the_first_process_makes_a_private_key_and_the_others_read_the_same(tmp_path: Path):
    path = tmp_path / "config" / "cluster_key"
    keys: list[ClusterKey] = []
    threads = [threading.Thread(target=lambda: keys.append(load_cluster_key(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1  # every racer reads the one key that was linked in
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["cluster_key"]  # no temporary file left behind
    assert load_cluster_key(path) == keys[0]


def test_a_key_open_to_other_users_or_malformed_is_refused(tmp_path: Path):
    path = tmp_path / "cluster_key"
    load_cluster_key(path)
    path.chmod(0o644)
    with pytest.raises(ClusterKeyError, match="open to other users"):
        load_cluster_key(path)
    path.chmod(0o600)
    path.write_text("not a key\n")
    with pytest.raises(ClusterKeyError, match="Z85"):
        load_cluster_key(path)
    with pytest.raises(ClusterKeyError, match="no cluster key"):
        load_cluster_key(tmp_path / "missing", create=False)


def test_a_key_path_that_cannot_be_made_is_a_key_error(tmp_path: Path):
    (tmp_path / "config").write_text("a file where the key's folder should be")
    with pytest.raises(ClusterKeyError, match="cannot be read or made"):
        load_cluster_key(tmp_path / "config" / "cluster_key")


def test_a_scheduler_with_an_unusable_key_exits_2_and_is_not_restarted(tmp_path: Path):
    path = tmp_path / "cluster_key"
    path.write_text("x" * 40 + "\n")
    path.chmod(0o640)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env["PAGEDSERVE_CLUSTER_KEY_FILE"] = str(path)
    supervised = subprocess.run(
        [sys.executable, "-m", "pagedserve.common.supervisor", "pagedserve.scheduler"],
        cwd=ROOT, env=env, capture_output=True,
        timeout=60,
    )  # fmt: skip
    assert supervised.returncode == 2, supervised.stderr.decode()[-2000:]
    assert b"cluster_key_unusable" in supervised.stderr + supervised.stdout
    assert b"not_restarted" in supervised.stderr + supervised.stdout
