"""Wire 1 framing: a type byte and a msgpack body per request, typed decoders only.

Frames of a request, as an engine core's DEALER socket receives them::

    [type byte, msgpack body, *zero-copy extra frames]

(the ROUTER in front prepends the engine identity, ``rank.to_bytes(2, "little")``, and
strips it on arrival). Every body decodes into one declared ``msgspec.Struct`` type;
nothing is unpickled, an unknown type byte or a body of the wrong shape raises
:class:`WireError`, and the receiver drops that message and keeps serving.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from aserve.wire.messages import EngineCoreOutputs, EngineCoreRequest

#: An engine core's last message on every PUSH socket.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"


class RequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    EXECUTOR_FAILED = b"\x04"
    WAKEUP = b"\x05"


class WireError(ValueError):
    """A message that does not follow the protocol."""


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    client_index: int
    call_id: int
    method: str
    args: list[Any] = []


class StartDPWave(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    wave: int
    exclude_engine_index: int | None = None


class EngineReady(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The first message an engine core sends each API server."""

    engine_index: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    kv_capacity_tokens: int


class DPLoads(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the DP coordinator publishes to every API server: per engine, in DP-rank
    order, ``(waiting, running, kv_cache_usage)``; the current wave; whether the
    engines are running a wave."""

    loads: list[tuple[int, int, float]]
    wave: int = 0
    engines_running: bool = False


_BODY_TYPES: dict[RequestType, Any] = {
    RequestType.ADD: EngineCoreRequest,
    RequestType.ABORT: list[str],
    RequestType.START_DP_WAVE: StartDPWave,
    RequestType.UTILITY: UtilityRequest,
    RequestType.EXECUTOR_FAILED: None,
    RequestType.WAKEUP: None,
}


class RequestEncoder:
    """Encodes request bodies, reusing one buffer between calls for the body bytes."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, kind: RequestType, body: Any = None) -> list[bytes]:
        return [kind.value, b"" if body is None else self._encoder.encode(body)]


class RequestDecoder:
    """Decodes ``[type byte, body]`` into ``(RequestType, typed body)``."""

    def __init__(self) -> None:
        self._decoders = {
            kind: msgspec.msgpack.Decoder(body_type) for kind, body_type in _BODY_TYPES.items() if body_type is not None
        }

    def decode(self, frames: list[bytes] | list[memoryview]) -> tuple[RequestType, Any]:
        if len(frames) < 2:
            raise WireError(f"a request needs a type byte and a body, got {len(frames)} frame(s)")
        try:
            kind = RequestType(bytes(frames[0]))
        except ValueError:
            raise WireError(f"unknown request type byte {bytes(frames[0])!r}") from None
        decoder = self._decoders.get(kind)
        if decoder is None:
            return kind, None
        try:
            return kind, decoder.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            raise WireError(f"malformed {kind.name} body: {exc}") from exc


class OutputsEncoder:
    """Encodes ``EngineCoreOutputs`` into a reused bytearray (the output task's buffer)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer = bytearray(4096)

    def encode(self, outputs: EngineCoreOutputs) -> memoryview:
        """The encoded bytes, valid until the next call (send them before encoding again)."""
        self._encoder.encode_into(outputs, self._buffer)
        return memoryview(self._buffer)


def decode_outputs(data: bytes | memoryview, decoder: msgspec.msgpack.Decoder | None = None) -> EngineCoreOutputs:
    """Decode one engine step's outputs; raises WireError on anything else."""
    try:
        return (decoder or _OUTPUTS_DECODER).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"malformed EngineCoreOutputs: {exc}") from exc


_OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
