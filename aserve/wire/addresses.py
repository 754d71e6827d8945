"""Where the wire-1 sockets of one server live (docs/design.md §2, §7).

API server ``i`` binds one ROUTER (requests out) and one PULL (outputs in); with more
than one engine, the DP coordinator binds a PULL (engines' load figures), an XPUB (load
figures to the API servers) and a ROUTER (START_DP_WAVE to the engines). Every engine
core connects a DEALER and a PUSH to every API server, and a PUSH and a DEALER to the
coordinator. On one machine the addresses are ``ipc://`` files in the instance's
private directory, fixed before anything starts; across machines they are
``tcp://HOST:0`` binds whose ports the kernel picks and the binders report.
"""

from __future__ import annotations

import msgspec


class WireAddresses(msgspec.Struct, array_like=True, frozen=True):
    api_inputs: tuple[str, ...]  # API server i's ROUTER
    api_outputs: tuple[str, ...]  # API server i's PULL
    coordinator_input: str | None = None  # coordinator's ROUTER (engines' DEALERs connect)
    coordinator_stats: str | None = None  # coordinator's PULL (engines' PUSHes connect)
    coordinator_publish: str | None = None  # coordinator's XPUB (API servers' SUBs connect)

    @property
    def api_count(self) -> int:
        return len(self.api_inputs)


def ipc_addresses(instance_dir: str, api_count: int, *, coordinator: bool) -> WireAddresses:
    def coord(name: str) -> str | None:
        return f"ipc://{instance_dir}/coordinator_{name}" if coordinator else None

    return WireAddresses(
        api_inputs=tuple(f"ipc://{instance_dir}/api{i}_input" for i in range(api_count)),
        api_outputs=tuple(f"ipc://{instance_dir}/api{i}_output" for i in range(api_count)),
        coordinator_input=coord("input"), coordinator_stats=coord("stats"), coordinator_publish=coord("publish"),
    )


def tcp_bind_address(host: str) -> str:
    """A ``tcp://`` bind on ``host`` at a port the kernel picks."""
    return f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
