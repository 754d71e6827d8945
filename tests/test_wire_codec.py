"""Wire 1 codecs: round trips, omitted defaults, and rejected garbage."""

from __future__ import annotations

import msgspec
import pytest

from aserve.sampling_params import SamplingParams
from aserve.wire.codec import (
    EngineReady,
    OutputsEncoder,
    RequestDecoder,
    RequestEncoder,
    RequestType,
    UtilityRequest,
    WireError,
    decode_outputs,
)
from aserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, TokenLogprobs


def test_add_round_trip():
    req = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"], seed=3), eos_token_ids=[1],
                            arrival_time=12.5, cache_salt="s", priority=2, client_index=1, data_parallel_rank=0)
    frames = RequestEncoder().encode(RequestType.ADD, req)
    assert frames[0] == b"\x00"
    kind, body = RequestDecoder().decode(frames)
    assert kind is RequestType.ADD and body == req


def test_abort_and_utility_round_trip():
    enc, dec = RequestEncoder(), RequestDecoder()
    assert dec.decode(enc.encode(RequestType.ABORT, ["a", "b"])) == (RequestType.ABORT, ["a", "b"])
    util = UtilityRequest(0, 7, "reset_prefix_cache")
    assert dec.decode(enc.encode(RequestType.UTILITY, util)) == (RequestType.UTILITY, util)
    assert dec.decode(enc.encode(RequestType.WAKEUP)) == (RequestType.WAKEUP, None)


def test_structs_are_positional_arrays_and_omitted_trailing_fields_take_defaults():
    ready = EngineReady(0, 2048, 100, 16, 1584)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ready)) == [0, 2048, 100, 16, 1584]  # no field names
    # msgspec 0.2x still writes trailing defaults of array-like structs, but a peer may
    # leave them out: a body holding only the required fields decodes with defaults.
    kind, body = RequestDecoder().decode([b"\x00", msgspec.msgpack.encode(["r", [5], []])])
    assert body == EngineCoreRequest("r", [5], SamplingParams())
    assert body.priority == 0 and body.client_index == 0 and body.sampling_params.max_tokens == 16


def test_unknown_type_byte_is_rejected():
    with pytest.raises(WireError, match="unknown request type"):
        RequestDecoder().decode([b"\x09", b"\x90"])


def test_malformed_bodies_are_rejected():
    dec = RequestDecoder()
    with pytest.raises(WireError, match="malformed ADD"):
        dec.decode([b"\x00", msgspec.msgpack.encode(["r", "not a list", []])])
    with pytest.raises(WireError, match="malformed ADD"):
        dec.decode([b"\x00", b"\xc1"])  # never valid msgpack
    with pytest.raises(WireError, match="malformed ADD"):  # a value SamplingParams rejects
        dec.decode([b"\x00", msgspec.msgpack.encode(["r", [1], [1, 0, 0, 1, -3.0]])])
    with pytest.raises(WireError, match="frame"):
        dec.decode([b"\x00"])


def test_outputs_round_trip_through_the_reused_buffer():
    enc = OutputsEncoder()
    first = EngineCoreOutputs(engine_index=1, outputs=[
        EngineCoreOutput("a", [5], new_logprobs=[TokenLogprobs([5, 6], [-0.1, -2.0], [1, 2])]),
        EngineCoreOutput("b", [7], finish_reason=FinishReason.STOP, stop_reason=7),
    ], timestamp=3.0)
    data = bytes(enc.encode(first))
    second = EngineCoreOutputs(outputs=[EngineCoreOutput("c", [1] * 5000)])
    big = bytes(enc.encode(second))  # grows the buffer
    assert decode_outputs(data) == first
    assert decode_outputs(big) == second
    assert decode_outputs(bytes(enc.encode(first))) == first
    with pytest.raises(WireError):
        decode_outputs(b"\x93\x01")
