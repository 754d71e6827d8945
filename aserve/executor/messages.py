"""Messages on wire 2, the engine core's shared-memory rings to and from its workers.

A call names one method from a fixed set, never an arbitrary attribute; arguments are
msgspec structs that carry only what changed since the last step.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from aserve.engine.scheduler import RunnerOutput
from aserve.engine.scheduler_output import SchedulerOutput

WorkerMethod = Literal["execute_model", "shutdown"]


class WorkerCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    method: WorkerMethod
    sched: SchedulerOutput | None = None
    output_rank: int = 0  # the one rank that replies


class WorkerReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ok: bool
    output: RunnerOutput | None = None
    error: str | None = None


CALL_DECODER = msgspec.msgpack.Decoder(WorkerCall)
REPLY_DECODER = msgspec.msgpack.Decoder(WorkerReply)
