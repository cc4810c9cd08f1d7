"""Fuzzes the wire codec (common/messages.py `decode`) and prints what became of every message.

    python scripts/fuzz_wire.py [--examples 10000] [--seed 0] [--json-out FILE]

Four kinds of input, each drawn by hypothesis (tests/chaos/test_wire_fuzz.py runs the same strategies, fewer
examples):
    random frames     any number of frames of random bytes
    random msgpack    any msgpack value (nil, bool, 64-bit int, float with NaN and infinities, str with
                      invalid UTF-8, bin, ext, arrays, maps, nested) under any type byte 0..255
    wrong field type  a valid message of each class with one field, at any depth, replaced by a value of a
                      kind its declared type never accepts
    valid             random valid messages of every class, whose decode must equal what was encoded
Decode may answer a message or raise CodecError; anything else is a crash: a process that reads the wire
would die of it. The table counts each outcome; --json-out writes it.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedserve.common.messages import MESSAGE_CLASSES, CodecError, Message, MsgType, decode, encode  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# Random msgpack, packed by hand so that a str may hold bytes that are not UTF-8


class RawStr(bytes):
    """Bytes that go on the wire as a msgpack str (a foreign client may send any bytes there)."""


def pack(value: Any) -> bytes:
    """`value` as msgpack; lists and dicts nest, RawStr becomes a str of its raw bytes."""
    if isinstance(value, RawStr):
        n = len(value)  # the strategies below keep it under 256: fixstr or str8
        return (bytes((0xA0 | n,)) if n < 32 else b"\xd9" + bytes((n,))) + bytes(value)
    if isinstance(value, list):
        n = len(value)
        header = bytes((0x90 | n,)) if n < 16 else b"\xdc" + struct.pack(">H", n)
        return header + b"".join(pack(v) for v in value)
    if isinstance(value, dict):
        n = len(value)
        header = bytes((0x80 | n,)) if n < 16 else b"\xde" + struct.pack(">H", n)
        return header + b"".join(pack(k) + pack(v) for k, v in value.items())
    return msgpack.packb(value, use_bin_type=True)


INT64_EDGES = [0, 1, -1, 127, 128, 255, 256, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # all msgpack can carry: a bigger int has no msgpack form
    st.sampled_from(INT64_EDGES),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(width=32),
    st.text(max_size=20),
    st.binary(max_size=20).map(RawStr),  # mostly invalid UTF-8 inside a str
    st.binary(max_size=20),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999)),  # ext type -1
)
msgpack_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=8),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), children, max_size=4),
    ),
    max_leaves=40,
)
random_frames = st.one_of(
    st.lists(st.binary(max_size=48), max_size=4),
    # Two frames under a type byte of ours, so that the payload's random bytes reach the msgpack parser
    st.tuples(st.sampled_from([bytes((t,)) for t in MESSAGE_CLASSES]), st.binary(max_size=64)).map(list),
)
typed_msgpack = st.tuples(st.integers(0, 255), msgpack_values).map(lambda t: [bytes((t[0],)), pack(t[1])])

# ---------------------------------------------------------------------------------------------------------
# Valid messages, drawn from the classes' own types and bounds (msgspec.inspect)

SMALL = 6  # entries per list and characters per string: the bounds are what matter, not the bulk


def valid_values(t: msgspec.inspect.Type) -> st.SearchStrategy[Any]:
    """Values of the msgspec type `t` that its decoder accepts (inside every Meta bound)."""
    mi = msgspec.inspect
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**63))
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**64 - 1)
        return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi]))
    if isinstance(t, mi.FloatType):
        lo = t.ge if t.ge is not None else t.gt
        hi = t.le if t.le is not None else t.lt
        return st.floats(
            min_value=lo,
            max_value=hi,
            exclude_min=t.gt is not None,
            exclude_max=t.lt is not None,
            allow_nan=False,
            allow_infinity=lo is None or hi is None,
        )
    if isinstance(t, mi.StrType):
        return st.text(min_size=t.min_length or 0, max_size=min(t.max_length or SMALL, SMALL))
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.UnionType):
        return st.one_of(*[valid_values(u) for u in t.types])
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        low = t.min_length or 0
        items = st.lists(
            valid_values(t.item_type), min_size=low, max_size=max(low, min(t.max_length or SMALL, SMALL))
        )
        return items if isinstance(t, mi.ListType) else items.map(tuple)
    if isinstance(t, mi.TupleType):
        return st.tuples(*[valid_values(u) for u in t.item_types])
    if isinstance(t, mi.StructType):
        fields = {f.name: valid_values(f.type) for f in t.fields}
        return st.fixed_dictionaries(fields).map(lambda kw: t.cls(**kw))
    raise TypeError(f"no strategy for {t}")


valid_messages = st.one_of(
    *[valid_values(msgspec.inspect.type_info(cls)) for cls in MESSAGE_CLASSES.values()]
)

# ---------------------------------------------------------------------------------------------------------
# Well-framed messages with one field of a kind its type never accepts


def _not_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return True
    return False


KIND_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "nil": st.none(),
    "bool": st.booleans(),
    "int": st.integers(-(2**63), 2**64 - 1),
    "float": st.floats(allow_nan=True, allow_infinity=True),
    "str": st.text(max_size=8),
    "bin": st.binary(max_size=8),
    "array": st.lists(st.integers(0, 5), max_size=3),
    "map": st.dictionaries(st.text(max_size=3), st.integers(0, 5), max_size=2),
    # A str whose bytes are not UTF-8: no field takes one (msgspec once let it escape as UnicodeDecodeError)
    "invalid_str": st.binary(min_size=1, max_size=8).filter(_not_utf8).map(RawStr),
}


def accepted_kinds(t: msgspec.inspect.Type) -> set[str]:
    """The msgpack kinds that a value of type `t` may arrive as (msgspec takes an int for a float)."""
    mi = msgspec.inspect
    if isinstance(t, mi.UnionType):
        return set().union(*(accepted_kinds(u) for u in t.types))
    if isinstance(t, mi.IntType):
        return {"int"}
    if isinstance(t, mi.FloatType):
        return {"int", "float"}
    if isinstance(t, (mi.StrType, mi.LiteralType)):
        return {"str"}
    if isinstance(t, mi.BoolType):
        return {"bool"}
    if isinstance(t, mi.NoneType):
        return {"nil"}
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.TupleType, mi.StructType)):
        return {"array"}  # structs are array_like
    raise TypeError(f"no kinds for {t}")


def field_slots(t: msgspec.inspect.Type, value: Any, path: tuple[int, ...] = ()) -> Iterator[tuple]:
    """(path into the wire array, the kinds accepted there) for every value inside `value`, of type `t`."""
    mi = msgspec.inspect
    if isinstance(t, mi.UnionType):  # the value's slot is its parent's; what lies inside is the member's
        members = [u for u in t.types if not isinstance(u, mi.NoneType)]
        if value is not None and len(members) == 1:
            yield from field_slots(members[0], value, path)
        return
    if isinstance(t, mi.StructType):
        inner = [(f.type, value[i], (*path, i)) for i, f in enumerate(t.fields)]
    elif isinstance(t, (mi.ListType, mi.VarTupleType)):
        inner = [(t.item_type, value[0], (*path, 0))] if value else []
    elif isinstance(t, mi.TupleType):
        inner = [(u, value[j], (*path, j)) for j, u in enumerate(t.item_types)]
    else:
        return
    for u, v, p in inner:
        yield p, accepted_kinds(u)
        yield from field_slots(u, v, p)


def replaced(wire: Any, path: tuple[int, ...], new: Any) -> Any:
    """A copy of the wire array `wire` with the value at `path` replaced by `new`."""
    if not path:
        return new
    copy = list(wire)
    copy[path[0]] = replaced(wire[path[0]], path[1:], new)
    return copy


@st.composite
def wrong_field_type(draw: st.DrawFn) -> list[bytes]:
    """A valid message's frames with one value, at any depth, replaced by one of a kind its field refuses."""
    msg = draw(valid_messages)
    wire = msgpack.unpackb(encode(msg)[1], strict_map_key=False)
    slots = list(field_slots(msgspec.inspect.type_info(type(msg)), wire))
    path, kinds = draw(st.sampled_from(slots))
    kind = draw(st.sampled_from(sorted(set(KIND_VALUES) - kinds)))
    return [bytes((msg.TYPE,)), pack(replaced(wire, path, draw(KIND_VALUES[kind])))]


valid_frames = valid_messages.map(lambda msg: (encode(msg), msg))

# ---------------------------------------------------------------------------------------------------------
# The run


def outcome(frames: list[bytes], expected: Message | None = None) -> str:
    """What `decode` made of `frames`: decoded, CodecError, or a crash (and for a valid message, whether
    what came back is what was encoded: a mismatch)."""
    try:
        msg = decode(frames)
    except CodecError:
        return "codec_error"
    except Exception:  # the defect this counts: anything else would end the process reading the wire
        return "crash"
    if expected is not None and msg != expected:
        return "mismatch"
    if type(msg) is not MESSAGE_CLASSES[MsgType(frames[0][0])]:
        return "mismatch"
    return "decoded"


KINDS: dict[str, tuple[st.SearchStrategy[Any], Callable[[Any], str]]] = {
    "random frames": (random_frames, outcome),
    "random msgpack under every type byte": (typed_msgpack, outcome),
    "wrong field type": (wrong_field_type(), outcome),
    "valid round trip": (valid_frames, lambda pair: outcome(*pair)),
}


def run_kind(name: str, examples: int, random_seed: int) -> Counter[str]:
    strategy, judge = KINDS[name]
    counts: Counter[str] = Counter()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # count what is sent; nothing to shrink
        suppress_health_check=list(HealthCheck),
    )
    @seed(random_seed)  # reproducible runs
    @given(strategy)
    def one(value: Any) -> None:
        counts[judge(value)] += 1

    one()
    return counts


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--examples", type=int, default=10_000, help="messages per kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    results: dict[str, dict[str, int]] = {}
    print(f"{'kind':40s} {'sent':>7s} {'CodecError':>10s} {'decoded':>8s} {'mismatch':>8s} {'crashes':>8s}")
    for name in KINDS:
        counts = run_kind(name, args.examples, args.seed)
        row = {
            "sent": sum(counts.values()),
            "codec_error": counts["codec_error"],
            "decoded": counts["decoded"],
            "mismatch": counts["mismatch"],
            "crashes": counts["crash"],
        }
        results[name] = row
        print(
            f"{name:40s} {row['sent']:7d} {row['codec_error']:10d} {row['decoded']:8d} {row['mismatch']:8d} "
            f"{row['crashes']:8d}"
        )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"examples_per_kind": args.examples, "kinds": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
