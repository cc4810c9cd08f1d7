"""Property-based fuzzing of the wire codec: whatever arrives on a socket, `decode` answers a message of the
type byte's class or raises CodecError, which every receive loop catches; nothing else escapes to end the
process. The strategies are scripts/fuzz_wire.py's, which runs them at 10,000 examples a kind for
docs/reliability.md. Each test names the defect it guards (issue 20).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from pagedserve.common.messages import MESSAGE_CLASSES, CodecError, Message, MsgType, decode, encode
from scripts.fuzz_wire import (
    KIND_VALUES,
    RawStr,
    accepted_kinds,
    field_slots,
    pack,
    random_frames,
    replaced,
    typed_msgpack,
    valid_messages,
    valid_values,
    wrong_field_type,
)
from scripts.fuzz_wire import main as fuzz_main

FUZZ = settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
# One value of each msgpack kind, for the exhaustive wrong-type test
ONE_OF_KIND: dict[str, Any] = {
    "nil": None,
    "bool": True,
    "int": 3,
    "float": 0.5,
    "str": "x",
    "bin": b"x",
    "array": [1],
    "map": {},
    "invalid_str": RawStr(b"\xff"),
}


def _decode_or_codec_error(frames: list[bytes]) -> Message | None:
    """The decoded message, or None on CodecError; any other exception fails the test."""
    try:
        msg = decode(frames)
    except CodecError:
        return None
    assert type(msg) is MESSAGE_CLASSES[MsgType(frames[0][0])]
    return msg


@FUZZ
@given(random_frames)
def test_random_frames_raise_only_codec_error(frames: list[bytes]) -> None:
    """Random bytes on the client or worker port (any number of frames) must not end the scheduler."""
    _decode_or_codec_error(frames)


@FUZZ
@given(typed_msgpack)
def test_random_msgpack_under_every_type_byte_decodes_or_raises_codec_error(frames: list[bytes]) -> None:
    """Random msgpack under the client type bytes killed the scheduler: NaN, 64-bit edges, invalid UTF-8 in
    a str, ext types and nesting under any of the 256 type bytes give a message or a CodecError."""
    _decode_or_codec_error(frames)


@FUZZ
@given(wrong_field_type())
def test_a_field_of_the_wrong_type_anywhere_raises_codec_error(frames: list[bytes]) -> None:
    """Well-framed messages with wrong field types killed the scheduler (9 of 14 crafted ones, e.g. an
    AbortRequest whose request id is a list): one value of a kind its field never takes, at any depth of
    any message, is a CodecError at decode, never a message handed to a handler."""
    with pytest.raises(CodecError):
        decode(frames)


@pytest.mark.parametrize("cls", MESSAGE_CLASSES.values(), ids=lambda c: c.__name__)
def test_every_field_of_every_message_is_reached_by_the_wrong_type_fuzz(cls: type) -> None:
    """The wrong-type fuzz can only guard the fields it reaches: each class's example with every list
    non-empty exposes a slot for each of its fields, nested ones included."""
    info = msgspec.inspect.type_info(cls)
    msg = _full_example(info)
    wire = msgpack.unpackb(encode(msg)[1], strict_map_key=False)
    slots = dict(field_slots(info, wire))
    assert {(i,) for i in range(len(info.fields))} <= set(slots)
    assert decode([bytes((cls.TYPE,)), pack(wire)]) == msg
    for path, kinds in slots.items():
        for kind in sorted(set(KIND_VALUES) - kinds):
            with pytest.raises(CodecError):
                decode([bytes((cls.TYPE,)), pack(replaced(wire, path, ONE_OF_KIND[kind]))])


def _full_example(t: msgspec.inspect.Type) -> Any:
    """A valid value of `t` whose lists each hold one entry and whose optional fields are set, so that every
    nested field has a place in the wire array."""
    mi = msgspec.inspect
    if isinstance(t, mi.StructType):
        return t.cls(*[_full_example(f.type) for f in t.fields])
    if isinstance(t, mi.UnionType):
        members = [u for u in t.types if not isinstance(u, mi.NoneType)]
        return _full_example(members[0])
    if isinstance(t, mi.ListType):
        return [_full_example(t.item_type)]
    if isinstance(t, mi.VarTupleType):
        return (_full_example(t.item_type),)
    if isinstance(t, mi.TupleType):
        return tuple(_full_example(u) for u in t.item_types)
    if isinstance(t, mi.IntType):
        return t.ge if t.ge is not None else 0  # every int bound here is a ge with room above it
    if isinstance(t, mi.FloatType):
        return t.le if t.le is not None else 0.0  # every float here has an inclusive upper bound
    if isinstance(t, mi.StrType):
        return "s"
    if isinstance(t, mi.LiteralType):
        return t.values[0]
    if isinstance(t, mi.BoolType):
        return True
    raise TypeError(f"no example for {t}")


@FUZZ
@given(valid_messages)
def test_valid_messages_of_every_class_round_trip(msg: Message) -> None:
    """The typed codec must not refuse what our own processes send, anywhere inside the ranges: a refused
    StepPlan or StepOutput stalls every request."""
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize("cls", MESSAGE_CLASSES.values(), ids=lambda c: c.__name__)
def test_the_valid_message_strategy_draws_every_class(cls: type) -> None:
    """The round trip above covers each class only if its strategy builds one: it does, from the class's
    own types and bounds."""
    strategy = valid_values(msgspec.inspect.type_info(cls))

    @settings(max_examples=20, deadline=None, database=None)
    @given(strategy)
    def draws(msg: Message) -> None:
        assert type(msg) is cls
        assert decode(encode(msg)) == msg

    draws()


def test_accepted_kinds_match_the_decoder() -> None:
    """The wrong-type fuzz trusts `accepted_kinds`: an int is taken where a float goes, a bool is not taken
    where an int goes, nil only where the type allows None."""
    info = {f.name: f.type for f in msgspec.inspect.type_info(MESSAGE_CLASSES[MsgType.STEP_OUTPUT]).fields}
    assert accepted_kinds(info["gpu_time_s"]) == {"int", "float"}
    assert accepted_kinds(info["step_id"]) == {"int"}
    assert decode([bytes((MsgType.STEP_OUTPUT,)), pack([1, [], [], [], 2, 0])]).gpu_time_s == 2.0
    with pytest.raises(CodecError):
        decode([bytes((MsgType.STEP_OUTPUT,)), pack([True, [], [], []])])


def test_fuzz_script_counts_every_message_and_writes_json(tmp_path: Path) -> None:
    """The figures for docs/reliability.md come from scripts/fuzz_wire.py: every message sent is counted
    once, and none of them crashes decode."""
    out = tmp_path / "fuzz.json"
    results = fuzz_main(["--examples", "50", "--json-out", str(out)])
    assert set(results) == {"random frames", "random msgpack under every type byte", "wrong field type",
                            "valid round trip"}  # fmt: skip
    for row in results.values():
        assert row["sent"] == 50 == row["codec_error"] + row["decoded"] + row["mismatch"] + row["crashes"]
        assert row["crashes"] == 0 and row["mismatch"] == 0
    assert results["wrong field type"]["codec_error"] == 50
    assert results["valid round trip"]["decoded"] == 50
    assert json.loads(out.read_text())["kinds"] == results
