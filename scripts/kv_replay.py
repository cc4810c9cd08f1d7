"""Renders two KV traces side by side: an animated GIF and a PNG of the moment of peak load.

    python scripts/kv_replay.py render A.jsonl B.jsonl --gif replay.gif --png peak.png
    python scripts/kv_replay.py simulate --out-dir docs/images    # paged vs reserved-max, no model needed

A trace is what `--kv-trace FILE` makes the scheduler record (or `bench_throughput.py --kv-trace DIR`, one
per run): JSON lines, a header, then snapshots (common/kv_view.py). Each side shows its block map as the
dashboard draws it (free grey, cached pale green, shared near-black, in use one hue per request), its
running requests and KV waste (allocated slots not yet written) underneath, and the running sequences over
time. The traces are aligned on their first snapshot; one that ended shows its last frame. The PNG is the
moment of peak load: when the most requests are live (running or waiting) in either trace.

`simulate` records both traces first, with the real scheduler core and no model (scripts/_kv_sim.py): the
same synthetic workload and the same KV pool under `--kv-policy paged` and `--kv-policy reserved-max` (the
scheduler's own baseline mode, which claims max_model_len slots per sequence at admission), then renders
them. Real traces of a served model: `bench_throughput.py --runs paged,reserved-max --kv-trace DIR`.
"""

from __future__ import annotations

import argparse
import colorsys
import io
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: make the project importable

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from pagedserve.common.kv_view import TRACE_FORMAT  # noqa: E402

# the dashboard's colours (api/static/dashboard/dashboard.js)
FREE_RGB, CACHED_RGB = (0xE3, 0xE6, 0xEA), (0x9F, 0xD8, 0xAC)
SHARED_RGB, UNLISTED_RGB = (0x1F, 0x22, 0x30), (0x8A, 0x8F, 0x98)


def hue_of(request_id: str) -> int:
    """The dashboard's hue for a request (api/static/dashboard/dashboard.js: FNV-1a, then fmix32)."""
    h = 0x811C9DC5
    data = request_id.encode("utf-16-le", "surrogatepass")  # UTF-16 code units, as charCodeAt sees them
    for i in range(0, len(data), 2):
        h = ((h ^ (data[i] | data[i + 1] << 8)) * 0x01000193) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h % 360


def request_rgb(request_id: str) -> tuple[int, int, int]:
    r, g, b = colorsys.hls_to_rgb(hue_of(request_id) / 360, 0.52, 0.70)
    return round(r * 255), round(g * 255), round(b * 255)


def load_trace(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the snapshots of a trace file."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path}: empty")
    header = json.loads(lines[0])
    if header.get("format") != TRACE_FORMAT:
        raise SystemExit(f"{path}: not a KV trace (its first line should name {TRACE_FORMAT})")
    frames = [f for f in map(json.loads, lines[1:]) if "cells" in f]
    if not frames:
        raise SystemExit(f"{path}: no snapshot")
    return header, frames


def cell_image(frame: dict[str, Any], width: int) -> np.ndarray:
    """The block map as an RGB array, `width` cells a row."""
    colours: list[tuple[int, int, int]] = []
    rows = frame["requests"]
    runs = frame["cells"]  # flat: state, owner, length, ...
    for state, owner, length in zip(runs[0::3], runs[1::3], runs[2::3], strict=True):
        if state == 0:
            rgb = FREE_RGB
        elif state == 1:
            rgb = CACHED_RGB
        elif state == 3:
            rgb = SHARED_RGB
        else:
            rgb = request_rgb(rows[owner - 1]["request_id"]) if 0 < owner <= len(rows) else UNLISTED_RGB
        colours.extend([rgb] * length)
    height = -(-len(colours) // width)
    colours.extend([(255, 255, 255)] * (height * width - len(colours)))
    return np.array(colours, np.uint8).reshape(height, width, 3)


def at(frames: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The last snapshot at or before `t` seconds after the trace's first."""
    t0 = frames[0]["time_s"]
    index = 0
    for i, frame in enumerate(frames):
        if frame["time_s"] - t0 <= t:
            index = i
        else:
            break
    return frames[index]


def waste(frame: dict[str, Any]) -> float:
    allocated = frame["slots_allocated"]
    return 1 - frame["slots_used"] / allocated if allocated else 0.0


class Renderer:
    """Draws frames of two traces side by side."""

    def __init__(self, traces: list[tuple[str, list[dict[str, Any]]]], title: str) -> None:
        self.traces = traces
        self.title = title
        self.series = []
        for _, frames in traces:
            t0 = frames[0]["time_s"]
            self.series.append(([f["time_s"] - t0 for f in frames], [f["num_running_seqs"] for f in frames]))
        self.duration = max(times[-1] for times, _ in self.series)
        self.max_running = max(max(running) for _, running in self.series) or 1

    def draw(self, t: float) -> Image.Image:
        fig, axes = plt.subplots(
            2, len(self.traces), figsize=(5 * len(self.traces), 5.4), dpi=80,
            gridspec_kw={"height_ratios": [3, 1.2]}, squeeze=False,
        )  # fmt: skip
        fig.suptitle(f"{self.title}   t = {t:5.1f} s", fontsize=11)
        for column, ((label, frames), (times, running)) in enumerate(
            zip(self.traces, self.series, strict=True)
        ):
            frame = at(frames, t)
            done = t > times[-1]
            top, bottom = axes[0][column], axes[1][column]
            width = max(8, int(np.ceil(np.sqrt(sum(frame["cells"][2::3]) * 1.6))))
            top.imshow(cell_image(frame, width), interpolation="nearest", aspect="equal")
            top.set_xticks([])
            top.set_yticks([])
            top.set_title(label + ("  (finished)" if done else ""), fontsize=11)
            top.set_xlabel(
                f"running {frame['num_running_seqs']:3d}   waiting {frame['num_waiting_seqs']:3d}   "
                f"KV waste {waste(frame):5.1%}\nblocks used {frame['blocks_used']} / {frame['num_blocks']}"
                f"   cached {frame['blocks_cached']}   shared {frame['blocks_shared']}",
                fontsize=9, family="monospace",
            )  # fmt: skip
            bottom.plot(times, running, color="#2980b9", linewidth=1)
            bottom.axvline(min(t, self.duration), color="#c0392b", linewidth=1)
            bottom.set_xlim(0, self.duration)
            bottom.set_ylim(0, self.max_running * 1.1)
            bottom.set_ylabel("running", fontsize=8)
            bottom.set_xlabel("s", fontsize=8)
            bottom.tick_params(labelsize=7)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        plt.close(fig)
        buffer.seek(0)
        return Image.open(buffer).convert("RGB")

    def peak_time(self) -> float:
        """When the most requests are live in either trace."""
        best = (-1, 0.0)
        for frames in (f for _, f in self.traces):
            t0 = frames[0]["time_s"]
            for frame in frames:
                best = max(best, (frame["num_requests"], frame["time_s"] - t0))
        return best[1]


def render(
    traces: list[tuple[str, Path]],
    gif: Path | None,
    png: Path | None,
    num_frames: int,
    fps: float,
    title: str,
) -> None:
    loaded = [(label, load_trace(path)[1]) for label, path in traces]
    renderer = Renderer(loaded, title)
    if png is not None:
        renderer.draw(renderer.peak_time()).save(png)
        print(f"wrote {png} (peak load at {renderer.peak_time():.1f} s)")
    if gif is not None:
        times = np.linspace(0, renderer.duration, num_frames)
        images = [renderer.draw(float(t)).quantize(colors=128) for t in times]
        images[0].save(
            gif, save_all=True, append_images=images[1:], duration=int(1000 / fps), loop=0, optimize=True
        )
        print(f"wrote {gif} ({len(images)} frames over {renderer.duration:.1f} s of trace)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="render two recorded traces")
    r.add_argument("traces", nargs=2, type=Path)
    r.add_argument("--labels", nargs=2, default=None, help="default: each trace's kv_policy")
    s = sub.add_parser("simulate", help="record paged and reserved-max traces of one workload, then render")
    s.add_argument("--out-dir", type=Path, required=True)
    s.add_argument("--num-blocks", type=int, default=768)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--max-model-len", type=int, default=1024)
    s.add_argument("--requests", type=int, default=96)
    s.add_argument("--seed", type=int, default=0)
    for q in (r, s):
        q.add_argument("--gif", type=Path, default=None)
        q.add_argument("--png", type=Path, default=None)
        q.add_argument("--frames", type=int, default=90)
        q.add_argument("--fps", type=float, default=10.0)
    args = p.parse_args(argv)
    if args.command == "simulate":
        from scripts._kv_sim import Workload, simulate

        workload = Workload(
            args.num_blocks, args.block_size, args.max_model_len, args.requests, seed=args.seed
        )
        args.out_dir.mkdir(parents=True, exist_ok=True)
        traces = []
        for policy in ("paged", "reserved-max"):
            path = args.out_dir / f"kv-trace-{policy}.jsonl"
            steps = simulate(workload, policy, path)
            print(f"{policy}: {steps} steps, {path}")
            traces.append((policy, path))
        gif = args.gif or args.out_dir / "kv-replay.gif"
        png = args.png or args.out_dir / "kv-replay-peak.png"
        title = (
            f"{args.requests} requests, {args.num_blocks} blocks of {args.block_size} tokens, "
            f"max_model_len {args.max_model_len}"
        )
        render(traces, gif, png, args.frames, args.fps, title)
        return
    labels = args.labels or [load_trace(path)[0].get("kv_policy", path.stem) for path in args.traces]
    render(
        list(zip(labels, args.traces, strict=True)),
        args.gif,
        args.png,
        args.frames,
        args.fps,
        "same workload",
    )


if __name__ == "__main__":
    main()
