"""The handshake between a headless node and the front-end node (docs/design.md §7).

The front end's supervisor binds a ROUTER at ``--dp-address:--dp-rpc-port`` (a CURVE
server keyed by the DP secret, see ``aserve.wire.auth``); a headless node's supervisor
connects a DEALER and says which DP ranks it runs::

    node  ── [HELLO, NodeHello] ──►  front end
    node  ◄─ [WELCOME, WireAddresses] or [REFUSED, reason]
    ... the node's engine cores connect to every address and send READY ...
    node  ── [FAILED, reason] ──►    (one of its processes died: the server goes down)
    node  ◄─ [STOP]                  (the front end is stopping: stop the engines)

Bodies are msgpack with typed decoders; an unknown kind or a bad body is dropped.
"""

from __future__ import annotations

import msgspec

HELLO = b"HELLO"
WELCOME = b"WELCOME"
REFUSED = b"REFUSED"
FAILED = b"FAILED"
STOP = b"STOP"


class NodeHello(msgspec.Struct, array_like=True, frozen=True):
    data_parallel_size: int
    start_rank: int
    local_size: int
    tensor_parallel_size: int
    model_name: str  # the model directory's name: both nodes must serve the same model
    pipeline_parallel_size: int = 1


def check_hello(hello: NodeHello, *, dp_size: int, first_remote_rank: int, tp_size: int, model_name: str,
                taken: set[int], pp_size: int = 1) -> str | None:
    """Why the front end refuses this node, or None to welcome it."""
    ranks = range(hello.start_rank, hello.start_rank + hello.local_size)
    if hello.data_parallel_size != dp_size:
        return f"the front end serves --dp {dp_size}, the node says --dp {hello.data_parallel_size}"
    if hello.tensor_parallel_size != tp_size:
        return f"the front end uses --tp {tp_size}, the node --tp {hello.tensor_parallel_size}"
    if hello.pipeline_parallel_size != pp_size:
        return f"the front end uses --pp {pp_size}, the node --pp {hello.pipeline_parallel_size}"
    if hello.model_name != model_name:
        return f"the front end serves model {model_name!r}, the node {hello.model_name!r}"
    if hello.local_size < 1 or ranks.start < first_remote_rank or ranks.stop > dp_size:
        return f"ranks {ranks.start}..{ranks.stop - 1} are not remote ranks of this server ({first_remote_rank}..{dp_size - 1})"
    if taken & set(ranks):
        return f"ranks {sorted(taken & set(ranks))} already have a node"
    return None
