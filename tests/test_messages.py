"""Every message type round-trips through the codec; foreign frames give a CodecError, not a crash."""

from __future__ import annotations

import msgpack
import pytest

from common.messages import (
    MESSAGE_CLASSES,
    AbortRequest,
    CodecError,
    Fork,
    Heartbeat,
    InfoReply,
    InfoRequest,
    NewSequence,
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
        ]
    ),
    RequestError("req-9", "invalid_request_error", "prompt too long: 9000 > 2048"),
    InfoReply(41, True, "/models/x", "x", 2048, 4096, 16, 512, "# TYPE a gauge\na 1\n"),
    WorkerReady(512, 16, 2048, 4096, [2, 5], "/models/x", "x", num_cpu_blocks=64, worker_id="9f2c"),
    Heartbeat("9f2c"),
    StepPlan(
        step_id=7,
        freed_seq_ids=[1, 4],
        new_seqs=[
            NewSequence(9, [1, 2, 3], [5, 0], 0, 0.0, 1.0, 0, 123, -1),
            NewSequence(10, [4], [1], 0, 0.0, 1.0, 0, 5, 8, beam=True),
        ],
        new_block_ids=[(2, [8]), (3, [10, 11])],
        scheduled_seq_ids=[9, 2, 3],
        num_scheduled_tokens=[3, 1, 1],
        swap_out=[(3, 0), (4, 1)],
        swap_in=[(5, 6)],
        new_block_tables=[(12, [6, 1])],
        block_copies=[(8, 9)],
        forks=[Fork(9, 13, 77), Fork(9, 14, 78)],
        clones=[(2, 15)],
        appended_tokens=[(2, 301), (15, 302)],
    ),
    StepOutput(7, [9, 2], [100, 200], [None, TokenLogprobs(-2.0)], 0.0042, 0.0005),
    Shutdown("bye"),
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
