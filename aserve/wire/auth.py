"""Authentication of the TCP wires between nodes: ZeroMQ CURVE keyed by a shared secret.

Every socket that binds a ``tcp://`` address of a multi-node server is a CURVE server
whose long-term key pair is derived from the secret (SHA-256 of a label and the
secret); every socket that connects to one is a CURVE client that must name the
server's public key, which it can only compute from the same secret. The server's
public key never crosses the network, so a peer without the secret cannot complete the
CURVE handshake: its connection is dropped before a single message is delivered, and
both sides see a handshake-failure event. Everything after the handshake is encrypted.
Nothing read from these sockets is unpickled either way (msgpack with typed decoders).
IPC sockets on one machine are protected by the instance directory's 0700 mode instead.
"""

from __future__ import annotations

import hashlib
import os

import zmq
import zmq.utils.z85

from aserve.errors import ConfigError

#: Minimum secret length: a short secret could be guessed by trying handshakes.
MIN_SECRET_BYTES = 16


def read_secret(value: str | None, path: str | None) -> bytes | None:
    """The secret from ``--dp-secret`` or ``--dp-secret-file`` (or ``ASERVE_DP_SECRET``
    through the caller); ConfigError when it is too short or both are given."""
    if value is not None and path is not None:
        raise ConfigError("give --dp-secret or --dp-secret-file, not both", param="dp_secret")
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the DP secret file {path!r}: {exc}", param="dp_secret_file") from exc
    elif value is not None:
        secret = value.encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"the DP secret must be at least {MIN_SECRET_BYTES} bytes", param="dp_secret")
    return secret


def new_secret() -> bytes:
    return os.urandom(24).hex().encode()


def _server_keys(secret: bytes) -> tuple[bytes, bytes]:
    secret_key = zmq.utils.z85.encode(hashlib.sha256(b"aserve-curve-server\0" + secret).digest())
    return zmq.curve_public(secret_key), secret_key


def secure_server(sock: zmq.Socket, secret: bytes | None) -> None:
    """Make ``sock`` a CURVE server for ``secret`` (before it binds); no-op without one."""
    if secret is None:
        return
    public, private = _server_keys(secret)
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = private


def secure_client(sock: zmq.Socket, secret: bytes | None) -> None:
    """Make ``sock`` a CURVE client of servers keyed by ``secret`` (before it connects)."""
    if secret is None:
        return
    public, _ = _server_keys(secret)
    client_public, client_private = zmq.curve_keypair()
    sock.curve_serverkey = public
    sock.curve_publickey = client_public
    sock.curve_secretkey = client_private
