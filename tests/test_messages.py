"""Every message type round-trips through the codec; foreign frames, wrong field types and values outside a
field's range give a CodecError, not a crash. (tests/chaos/test_wire_fuzz.py fuzzes the same codec.)"""

from __future__ import annotations

import math

import msgpack
import msgspec
import pytest

from pagedserve.common.messages import (
    MESSAGE_CLASSES,
    AbortRequest,
    CodecError,
    Fork,
    Heartbeat,
    InfoReply,
    InfoRequest,
    KVRequestRow,
    KVSnapshot,
    KVSnapshotRequest,
    NewSequence,
    PromptLogprobs,
    RequestError,
    RequestOutputs,
    SamplingParams,
    SeqOutput,
    Shutdown,
    StepOutput,
    StepPlan,
    SubmitRequest,
    TokenLogprobs,
    WorkerReady,
    decode,
    encode,
)
from pagedserve.common.wire_types import MAX_NUM_BLOCKS

PARAMS = SamplingParams(
    n=3, max_tokens=17, temperature=0.7, top_p=0.9, top_k=40, seed=2**63 + 5, stop_token_ids=(7, 9),
    ignore_eos=True, logprobs=4, stop=("\n\n", "日本"),
)  # fmt: skip

EXAMPLES = [
    SubmitRequest("req-1", [1, 2, 300000], PARAMS),
    SubmitRequest("req-2", [5], SamplingParams(), priority=-3, cache_salt="tenant-a"),
    SubmitRequest("req-3", [5, 6], SamplingParams(n=2, temperature=0.0, beam_width=4, length_penalty=0.5)),
    AbortRequest("req-1"),
    AbortRequest("req-1", 2, "stop"),
    InfoRequest(41),
    RequestOutputs(
        [
            SeqOutput("a", 0, [1, 2], [TokenLogprobs(-0.5, [1, 3], [-0.5, -1.25])] * 2, None, 12, 4),
            SeqOutput("b", 1, [], None, "length", 3),
            SeqOutput(
                "c", 0, [], None, None, 9, prompt_logprobs=PromptLogprobs(1, [TokenLogprobs(-1.5)], [7])
            ),
        ]
    ),
    RequestError("req-9", "invalid_request_error", "prompt too long: 9000 > 2048"),
    InfoReply(41, True, "/models/x", "x", 2048, 4096, 16, 512, "# TYPE a gauge\na 1\n"),
    InfoReply(42, True, "/models/x", "x", 2048, 4096, 16, 512, "", scheduling_policy="priority"),
    InfoReply(43, False, "", "", 0, 0, 0, 0, "", instance_id="pagedserve-x1"),
    WorkerReady(512, 16, 2048, 4096, [2, 5], "/models/x", "x", num_cpu_blocks=64, worker_id="9f2c"),
    WorkerReady(
        512, 16, 2048, 4096, [2], "/m", "x", worker_id="9f2c", max_num_seqs=256, max_num_batched_tokens=4096
    ),
    WorkerReady(
        512,
        16,
        2048,
        4096,
        [2],
        "/m",
        "x",
        num_host_tier_blocks=4096,
        num_disk_tier_blocks=65536,
        tier_block_bytes=1 << 21,
    ),
    Heartbeat("9f2c"),
    StepPlan(  # the KV tiers' copies (docs/kv_tiers.md)
        step_id=8,
        freed_seq_ids=[],
        new_seqs=[],
        new_block_ids=[],
        scheduled_seq_ids=[],
        num_scheduled_tokens=[],
        sampling_seq_ids=[],
        disk_writes=[(3, 70)],
        tier_offloads=[(12, 3), (13, 4)],
        disk_reads=[(71, 5)],
        tier_loads=[(6, 14)],
    ),
    StepOutput(8, [], [], [], failed_disk_reads=[5]),
    StepPlan(
        step_id=7,
        freed_seq_ids=[1, 4],
        new_seqs=[
            NewSequence(
                9, [1, 2, 3], [5, 0], 0, SamplingParams(temperature=0.7, top_p=0.9, top_k=40, logprobs=3), 123
            ),
            NewSequence(10, [4], [1], 0, SamplingParams(n=2, temperature=0.0, beam_width=4), 5),
        ],
        new_block_ids=[(2, [8]), (3, [10, 11])],
        scheduled_seq_ids=[9, 2, 3],
        num_scheduled_tokens=[3, 1, 1],
        sampling_seq_ids=[9, 3],
        swap_out=[(3, 0), (4, 1)],
        swap_in=[(5, 6)],
        new_block_tables=[(12, [6, 1])],
        block_copies=[(8, 9)],
        forks=[Fork(9, 13, 77), Fork(9, 14, 78)],
        clones=[(2, 15)],
        appended_tokens=[(2, 301), (15, 302)],
    ),
    StepOutput(7, [9, 2], [100, 200], [None, TokenLogprobs(-2.0)], 0.0042, 0.0005),
    StepOutput(
        8,
        [],
        [],
        [],
        prompt_logprobs=[(9, PromptLogprobs(3, [TokenLogprobs(-0.5, [4], [-0.25])] * 2, [2, 1]))],
    ),
    Shutdown("bye"),
    Shutdown("declared dead", reannounce=True),
    KVSnapshotRequest(5, 64),
    KVSnapshot(
        6,
        1.79e9,
        64,
        16,
        1,
        [0, 0, 10, 3, 0, 2, 2, 1, 5, 1, 0, 47],
        [
            KVRequestRow("req-1", "running", 4, 10, 3, 7, 2, 0, 16, 0.5, [10, 7]),
        ],
        1,
        7,
        2,
        2,
        112,
        50,
        128,
        0,
        4,
        0,
        0,
        1,
        0,
        0,
        10,
        3,
    ),  # fmt: skip
    KVSnapshot(
        6,
        1.79e9,
        64,
        16,
        1,
        [0, 2, 64],
        [],
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        num_host_tier_blocks=4096,
        host_tier_blocks_used=100,
        host_tier_hits_total=40,
        num_disk_tier_blocks=65536,
        disk_tier_blocks_used=1000,
    ),  # fmt: skip
]


def test_every_message_type_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_CLASSES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = encode(msg)
    assert len(frames) == 2 and frames[0] == bytes((msg.TYPE,))
    assert decode(frames) == msg


@pytest.mark.parametrize(
    "frames",
    [
        [b"\x01"],
        [b"\xff", msgpack.packb([1])],
        [b"\x01", b"\xc1not msgpack"],
        [b"\x01", msgpack.packb(["only-an-id"])],
        [b"", b""],
        [b"\x02", msgpack.packb(["req-1", None, "abort"]) + b"\x00"],  # trailing bytes
        [b"\x02", msgpack.packb(["req-1"]), b""],  # three frames
        [b"\x02", b"\x93\xa2\xff\xfe\xc0\xa5abort"],  # an AbortRequest whose request id is not UTF-8
    ],
)
def test_foreign_frames_raise_codec_error(frames):
    with pytest.raises(CodecError):
        decode(frames)


def test_sampling_params_validation():
    assert SamplingParams().validate() is None
    assert "n must" in SamplingParams(n=0).validate()
    assert "top_p" in SamplingParams(top_p=0.0).validate()
    assert "temperature" in SamplingParams(temperature=-1).validate()
    assert "logprobs" in SamplingParams(logprobs=21).validate()
    assert "stop" in SamplingParams(stop=("",)).validate()
    assert "beam width" in SamplingParams(n=3, beam_width=2, temperature=0.0).validate()
    assert "temperature" in SamplingParams(beam_width=2).validate()
    assert SamplingParams(n=2, beam_width=4, temperature=0.0).validate() is None


def _payload(value: object) -> list:
    return msgpack.unpackb(msgspec.msgpack.encode(value))


def _frames(msg_type: int, fields: list) -> list[bytes]:
    return [bytes((msg_type,)), msgpack.packb(fields, use_bin_type=True)]


@pytest.mark.parametrize(
    "msg_type, fields",
    [
        (2, [["req-1"], None, "abort"]),  # an AbortRequest whose request id is a list killed the scheduler
        (2, ["req-1", True, "abort"]),  # a bool where an int goes
        (2, ["req-1", 0, "finished-somehow"]),  # not a finish reason
        (1, ["r", [1, "2"], _payload(PARAMS), 0, ""]),  # a string token id
        (1, ["r", [1], _payload(PARAMS)[:3] + ["1.0"] + _payload(PARAMS)[4:], 0, ""]),  # top_p a string
        (30, [1, [], [], [], ["9"], [1]]),  # a StepPlan whose seq ids are strings
        (30, [1, [], [], [[2, 8]], [2], [1]]),  # new_block_ids pairs (seq_id, [blocks]) with an int
        (21, [7, [9], [100], [[-0.5, [1], ["x"]]]]),  # a string logprob
        (11, ["r", "some_new_kind", "msg"]),  # not an ErrorKind
        (20, [512, 16, 2048, 4096, [2], "/m", "x", 0, 5]),  # a worker id that is an int
    ],
)
def test_well_framed_messages_with_wrong_field_types_raise_codec_error(msg_type: int, fields: list) -> None:
    """9 of 14 such crafted messages killed the scheduler: the typed decoder refuses them all."""
    with pytest.raises(CodecError):
        decode(_frames(msg_type, fields))


@pytest.mark.parametrize(
    "msg",
    [
        SubmitRequest("r", [1], SamplingParams(temperature=math.nan)),
        SubmitRequest("r", [1], SamplingParams(top_p=math.inf)),
        SubmitRequest("r", [1], SamplingParams(n=2, beam_width=2, temperature=0.0, length_penalty=1e308)),
        SubmitRequest("r", [1], SamplingParams(n=0)),
        SubmitRequest("r", [1], SamplingParams(stop=("x",) * 17)),
        SubmitRequest("r", [1], SamplingParams(stop=("x" * 1025,))),
        SubmitRequest("r", [1], SamplingParams(stop_token_ids=(2**31,))),
        SubmitRequest("r" * 257, [1], SamplingParams()),
        SubmitRequest("r", [-1], SamplingParams()),
        AbortRequest("r", -1),
        WorkerReady(MAX_NUM_BLOCKS + 1, 16, 2048, 4096, [2], "/m", "x"),
        WorkerReady(512, 16, 2048, 4096, [2], "/m", "x", num_cpu_blocks=MAX_NUM_BLOCKS + 1),
        WorkerReady(512, 0, 2048, 4096, [2], "/m", "x"),
        StepPlan(1, [], [], [(0, [MAX_NUM_BLOCKS])], [0], [1], [0]),
        StepPlan(1, [-1], [], [], [], [], []),
        StepOutput(1, [0], [5], [TokenLogprobs(math.nan)]),
        StepOutput(1, [], [], [], prompt_logprobs=[(0, PromptLogprobs(0, [TokenLogprobs(-1.0)], [1]))]),
        StepOutput(1, [], [], [], prompt_logprobs=[(0, PromptLogprobs(1, [TokenLogprobs(0.5)], [1]))]),
        StepOutput(1, [], [], [], prompt_logprobs=[(0, PromptLogprobs(1, [TokenLogprobs(-1.0)], [0]))]),
        SubmitRequest("r", [1], SamplingParams(prompt_logprobs=21)),
        StepOutput(1, [0], [5], [None], gpu_time_s=-1.0),
    ],
    ids=lambda m: type(m).__name__,
)
def test_values_outside_a_fields_range_raise_codec_error(msg) -> None:
    """A fake WorkerReady claiming millions of KV blocks made the scheduler allocate hundreds of MB; a
    length_penalty of 1e308 overflowed the scheduler's beam scores. Bounds are checked at decode."""
    with pytest.raises(CodecError):
        decode(encode(msg))


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"n": 129}, "n must"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ("x",) * 17}, "stop strings"),
        ({"stop": ("x" * 1025,)}, "stop strings"),
        ({"stop": ("a\ud800",)}, "surrogate"),
        ({"stop_token_ids": (0,) * 1025}, "stop token ids"),
        ({"stop_token_ids": (-1,)}, "stop token ids"),
        ({"stop_token_ids": (2**31,)}, "stop token ids"),
        ({"beam_width": 17, "temperature": 0.0}, "beam width"),
        ({"beam_width": -1}, "beam width"),
        ({"length_penalty": 1e308}, "length_penalty"),
        ({"length_penalty": -1e308}, "length_penalty"),
        ({"length_penalty": math.nan}, "length_penalty"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 1, "beam_width": 2, "temperature": 0.0}, "prompt_logprobs"),
        ({"n": 2, "beam_width": 2, "temperature": 0.0, "length_penalty": 1e308}, "length_penalty"),
    ],
)
def test_every_sampling_field_has_a_finite_range(change: dict, problem: str) -> None:
    """`{"use_beam_search": true, "length_penalty": 1e308}` killed the server: every field is bounded and
    NaN fails every float's check."""
    assert problem in SamplingParams(**change).validate()


@pytest.mark.parametrize(
    "change",
    [
        {"n": 128},
        {"max_tokens": 2**31 - 1},
        {"temperature": 100.0},
        {"top_p": 1e-9},
        {"top_k": 2**31 - 1},
        {"seed": 2**64 - 1},
        {"seed": -(2**63)},
        {"logprobs": 20},
        {"prompt_logprobs": 20, "include_stop_str_in_output": True, "skip_special_tokens": False},
        {"prompt_logprobs": 0, "spaces_between_special_tokens": False},
        {"stop": ("x" * 1024,) * 16},
        {"stop_token_ids": tuple(range(1024))},
        {"n": 2, "beam_width": 16, "temperature": 0.0, "length_penalty": -100.0},
    ],
)
def test_sampling_params_at_their_bounds_are_valid_and_cross_the_wire(change: dict) -> None:
    """validate() and the decoder's bounds agree at each edge: what the api accepts, the scheduler decodes."""
    params = SamplingParams(**change)
    assert params.validate() is None
    assert decode(encode(SubmitRequest("r", [1], params))).params == params


def test_messages_build_by_position_and_keyword_and_sampling_params_stay_frozen() -> None:
    assert AbortRequest("r", 1, "stop") == AbortRequest(request_id="r", index=1, finish_reason="stop")
    assert StepPlan(1, [], [], [], [], [], []).swap_out == []
    a, b = StepPlan(1, [], [], [], [], [], []), StepPlan(2, [], [], [], [], [], [])
    a.forks.append(Fork(1, 2, 3))
    assert b.forks == []  # each message gets its own default list
    with pytest.raises(AttributeError):
        PARAMS.n = 4  # type: ignore[misc]
    assert hash(PARAMS) == hash(SamplingParams(**msgspec.structs.asdict(PARAMS)))
    assert msgspec.structs.replace(PARAMS, max_tokens=3).max_tokens == 3


def test_an_info_reply_crosses_between_old_and_new_peers() -> None:
    """InfoReply.instance_id came later: a scheduler without it reads as "" (no instance, accepted), and an
    older api reading a newer reply ignores the extra field."""

    class OldInfoReply(msgspec.Struct, array_like=True):  # the reply before instance_id
        query_id: int
        ready: bool
        model_root: str
        model_name: str
        max_model_len: int
        vocab_size: int
        block_size: int
        num_kv_blocks: int
        metrics_text: str
        scheduling_policy: str = "fcfs"

    old = OldInfoReply(5, True, "/m", "m", 2048, 4096, 16, 8, "", "priority")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=InfoReply).instance_id == ""
    new = InfoReply(5, True, "/m", "m", 2048, 4096, 16, 8, "", "priority", instance_id="pagedserve-x1")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldInfoReply) == old
