"""--kv-trace: the file's format, its size bound, and what scripts/kv_replay.py makes of two traces."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from pagedserve.common.config import SchedulerConfig, parse_config
from pagedserve.common.kv_view import TRACE_FORMAT
from pagedserve.scheduler.kv_trace import TRUNCATED_LINE, KVTrace
from pagedserve.scheduler.kv_views import KVViews
from scripts import kv_replay
from scripts._kv_sim import Workload, simulate
from tests.scheduler.conftest import make_harness


def _busy_harness():
    h = make_harness(num_blocks=32, block_size=4)
    h.submit("a", list(range(1, 30)), max_tokens=20, n=2, seed=0)
    h.step()
    return h


def test_trace_is_json_lines_and_stops_at_its_size_bound(tmp_path: Path) -> None:
    h = _busy_harness()
    path = tmp_path / "t.jsonl"
    trace = KVTrace(path, max_bytes=4000, interval_s=0.0)
    now = 0.0
    while not trace.stopped:
        h.step()
        now += 1
        trace.record(h.scheduler.kv_snapshot(4096), now, kv_policy="paged")
        assert now < 100
    data = path.read_bytes()
    assert len(data) <= 4000 and data.endswith(TRUNCATED_LINE)
    lines = [json.loads(line) for line in data.splitlines()]
    assert lines[0]["format"] == TRACE_FORMAT and lines[0]["num_blocks"] == 32
    assert lines[-1] == {"truncated": True} and len(lines) - 2 == trace.num_snapshots > 1
    assert all(line["requests"][0]["request_id"] == "a" for line in lines[1:-1])


def test_trace_records_at_most_once_per_interval_and_a_write_error_stops_only_the_trace(
    tmp_path: Path,
) -> None:
    config = parse_config(
        SchedulerConfig, ["--kv-trace", str(tmp_path / "t.jsonl"), "--kv-snapshot-interval-s", "60"]
    )
    views = KVViews(config)
    h = _busy_harness()
    for _ in range(5):
        views.after_step(h.scheduler)
    views.close()
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 2  # the header and one snapshot
    broken = KVViews(parse_config(SchedulerConfig, ["--kv-trace", str(tmp_path / "missing-dir" / "t.jsonl")]))
    broken.after_step(h.scheduler)  # logs and drops the trace
    broken.after_step(h.scheduler)
    assert broken._trace is None


def test_replay_renders_paged_against_reserved_max_from_the_same_workload(tmp_path: Path) -> None:
    workload = Workload(num_blocks=96, block_size=16, max_model_len=1024, num_requests=12, seed=1)
    steps = {p: simulate(workload, p, tmp_path / f"{p}.jsonl", every=4) for p in ("paged", "reserved-max")}
    assert steps["paged"] < steps["reserved-max"]  # the same requests finish sooner in the same pool
    _, paged = kv_replay.load_trace(tmp_path / "paged.jsonl")
    _, reserved = kv_replay.load_trace(tmp_path / "reserved-max.jsonl")
    assert max(f["num_running_seqs"] for f in paged) > max(f["num_running_seqs"] for f in reserved)
    assert max(kv_replay.waste(f) for f in reserved) > 0.5  # a whole max_model_len claimed, little written
    gif, png = tmp_path / "r.gif", tmp_path / "r.png"
    traces = [("paged", tmp_path / "paged.jsonl"), ("reserved-max", tmp_path / "reserved-max.jsonl")]
    kv_replay.render(traces, gif, png, num_frames=4, fps=5, title="test")
    with Image.open(gif) as image:
        assert image.n_frames == 4
    with Image.open(png) as image:
        assert image.size[0] > image.size[1] > 100


def test_replay_colours_match_the_page() -> None:
    # the hues dashboard.js gives these ids (computed with node from api/static/dashboard/dashboard.js)
    ids = [f"f2fb7f65c5ed-{i}" for i in range(1, 6)]
    assert [kv_replay.hue_of(i) for i in ids] == [253, 307, 51, 84, 10]
