"""Random JSON schemas for the structured-output tests: objects, arrays, enums, bounded numbers, nested
objects, required and optional properties, strings with lengths or patterns. Every schema's documents are
short, so that a random model at temperature 1 finishes one within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(8)
    if kind == 0:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == 1:
        return {"type": "boolean"}
    if kind == 2:
        return {
            "enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "a b", "é"], rng.randint(1, 4))
        }
    if kind == 3:
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == 4:
        return {"type": "string", "pattern": rng.choice(["^[a-c]{1,3}$", "^[0-9]{2}-[A-Z]$", "^(yes|no)$"])}
    if kind == 5:
        lo = rng.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(0, 20), 2)}
    if kind == 6:
        return {"type": "null"}
    return {"const": rng.choice(["fixed", 7, False])}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema (at depth 0) or any value's schema."""
    kind = rng.randrange(4) if depth else 0
    if kind == 0 and depth < 2:
        names = rng.sample(["id", "name", "tags", "point", "kind", "score", "ok", "note"], rng.randint(1, 4))
        props = {name: random_schema(rng, depth + 1) for name in names}
        required = [n for n in names if rng.random() < 0.6]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if kind == 1 and depth < 3:
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    return _leaf(rng)
