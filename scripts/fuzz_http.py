"""Sends N fuzzed requests to the api's generation endpoints and counts the answers: never a 5xx, never a
dead server, every 4xx with OpenAI's error body.

By default the api runs in-process in front of the api tests' fake scheduler (tiny checkpoint's tokenizer);
`--url` points it at a running server instead. Bodies are random JSON built from the endpoints' real field
names (typed, edge-case and junk values: huge ints, 1e308, NaN/Infinity literals, lone surrogates, deep
nesting) and random bytes. Prints a table and writes JSON.

    python scripts/fuzz_http.py -n 10000 --out bench-results/fuzz_http.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.api.protocol import CHAT_FIELDS, COMPLETION_FIELDS  # noqa: E402

ROUTES = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}
EDGE = [
    0,
    1,
    -1,
    2**31,
    2**63,
    2**64,
    -(2**64),
    10**400,
    1e308,
    -1e308,
    5e-324,
    0.5,
    100.5,
    True,
    None,
    "",
    {},
    [],
]
WORDS = ["hi", "stop", "\ud800", "\udfff", "a" * 5000, "é", "🙂", "\x00", "NaN", "user", "text"]
ERROR_KEYS = {"message", "type", "param", "code"}


def value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(10 if depth < 4 else 7)
    if kind == 0:
        return rng.choice(EDGE)
    if kind == 1:
        return rng.randint(-(2**70), 2**70)
    if kind == 2:
        return rng.choice(
            [float("nan"), float("inf"), -float("inf"), rng.uniform(-1e308, 1e308), rng.random()]
        )
    if kind in (3, 4):
        return "".join(rng.choice(WORDS) for _ in range(rng.randrange(4)))
    if kind == 5:
        return rng.randint(0, 8)
    if kind == 6:
        return rng.random() < 0.5
    if kind in (7, 8):
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(WORDS): value(rng, depth + 1) for _ in range(rng.randrange(3))}


def message(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return value(rng)
    entry = {
        "role": rng.choice(["system", "user", "assistant", "developer", "robot", 5]),
        "content": value(rng),
    }
    if rng.random() < 0.7:
        entry["content"] = rng.choice(WORDS[:2] + WORDS[4:])
    if rng.random() < 0.2:
        entry["name"] = value(rng)
    return entry


def body(rng: random.Random, route: str) -> bytes:
    """One fuzzed body: random bytes, a deep nest, or JSON from a plausible base and random real fields."""
    roll = rng.random()
    if roll < 0.05:
        return rng.randbytes(rng.randrange(200))
    if roll < 0.08:
        depth = rng.choice([100, 1000, 100_000])
        return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    base: dict[str, Any] = {"max_tokens": rng.randint(1, 4)}
    if route == "/v1/completions":
        base["prompt"] = rng.choice(["hi", [1, 2, 3], ["a", "b"], value(rng)])
    else:
        base["messages"] = [message(rng) for _ in range(rng.randint(0, 3))]
    names = sorted(ROUTES[route]) + ["frobnicate"]
    for name in rng.sample(names, rng.randrange(4)):
        base[name] = value(rng)
    return json.dumps(base, allow_nan=True).encode("utf-8", "surrogatepass")


def send(conn: http.client.HTTPConnection, route: str, data: bytes) -> tuple[int, str, str]:
    conn.request("POST", route, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return (
        response.status,
        response.getheader("Content-Type") or "",
        response.read().decode("utf-8", "replace"),
    )


def well_formed(status: int, content_type: str, text: str) -> bool:
    if status >= 500:
        return False
    if status >= 400:
        try:
            return (
                content_type.startswith("application/json") and set(json.loads(text)["error"]) == ERROR_KEYS
            )
        except (ValueError, KeyError, TypeError):
            return False
    if content_type.startswith("text/event-stream"):
        return text.endswith("data: [DONE]\n\n") and "internal_error" not in text
    return True


def fuzz(host: str, port: int, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    results: dict[str, dict[str, Any]] = {
        r: {"requests": 0, "status": Counter(), "5xx": 0, "malformed": 0, "crashes": 0} for r in ROUTES
    }
    conn = http.client.HTTPConnection(host, port, timeout=60)
    for _ in range(n):
        route = rng.choice(list(ROUTES))
        row = results[route]
        row["requests"] += 1
        try:
            status, content_type, text = send(conn, route, body(rng, route))
        except (OSError, http.client.HTTPException):
            row["crashes"] += 1  # no answer at all: the connection died
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=60)
            continue
        row["status"][status] += 1
        row["5xx"] += status >= 500
        row["malformed"] += not well_formed(status, content_type, text)
    conn.close()
    probe = http.client.HTTPConnection(host, port, timeout=30)
    status, _, _ = send(probe, "/v1/completions", b'{"prompt": "still here", "max_tokens": 2}')
    for row in results.values():
        row["status"] = {str(k): v for k, v in sorted(row["status"].items())}
    return {"requests": n, "seed": seed, "serving_after": status == 200, "endpoints": results}


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{'endpoint':<22} {'requests':>8}  {'status counts':<44} {'5xx':>4} {'malformed':>9} {'crashes':>7}"
    )
    for route, row in report["endpoints"].items():
        counts = " ".join(f"{k}:{v}" for k, v in row["status"].items())
        print(
            f"{route:<22} {row['requests']:>8}  {counts:<44} {row['5xx']:>4} {row['malformed']:>9} "
            f"{row['crashes']:>7}"
        )
    print(f"serving afterwards: {report['serving_after']}  ({report['elapsed_s']:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=10_000, help="requests to send")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default="", help="a running api; default: one in-process, fake scheduler")
    parser.add_argument("--out", default="bench-results/fuzz_http.json")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.url:
        url = urlparse(args.url)
        report = fuzz(url.hostname or "127.0.0.1", url.port or 80, args.n, args.seed)
    else:
        from pagedserve.common.config import ApiConfig
        from pagedserve.common.log import configure_logging
        from scripts.make_model import make_model
        from tests.api.harness import ApiServer

        configure_logging("api", "warning")  # 10,000 access lines would drown the table

        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_model(Path(tmp) / "tiny-llama", preset="tiny", seed=0)
            server = ApiServer(str(model_dir), ApiConfig(max_seqs_per_request=32), max_model_len=48)
            try:
                report = fuzz("127.0.0.1", server.port, args.n, args.seed)
            finally:
                server.close()
    report["elapsed_s"] = round(time.perf_counter() - start, 1)
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
