"""The pieces of a multi-node server that need no processes: the DP secret, the CURVE
keys it derives (a peer with another secret is refused by ZeroMQ itself), and the
front end's check of a headless node's HELLO."""

from __future__ import annotations

import pytest
import zmq

from aserve.errors import ConfigError
from aserve.wire.auth import read_secret, secure_client, secure_server
from aserve.wire.handshake import NodeHello, check_hello


def test_read_secret(tmp_path):
    assert read_secret(None, None) is None
    assert read_secret("x" * 16, None) == b"x" * 16
    path = tmp_path / "secret"
    path.write_text("y" * 20 + "\n")
    assert read_secret(None, str(path)) == b"y" * 20  # the trailing newline of an editor is not part of it
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        read_secret("short", None)
    with pytest.raises(ConfigError, match="not both"):
        read_secret("x" * 16, str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        read_secret(None, str(tmp_path / "missing"))


@pytest.mark.parametrize("client_secret, delivered", [(b"s" * 16, True), (b"t" * 16, False)])
def test_curve_admits_only_peers_with_the_secret(client_secret, delivered):
    ctx = zmq.Context()
    server = ctx.socket(zmq.PULL)
    secure_server(server, b"s" * 16)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client = ctx.socket(zmq.PUSH)
    client.setsockopt(zmq.IMMEDIATE, 1)  # queue only on completed connections
    secure_client(client, client_secret)
    monitor = client.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    client.connect(f"tcp://127.0.0.1:{port}")
    try:
        assert monitor.poll(10_000), "no handshake outcome"
        event = int.from_bytes(monitor.recv_multipart()[0][:2], "little")
        assert (event == zmq.EVENT_HANDSHAKE_SUCCEEDED) == delivered
        if delivered:
            client.send(b"hello")
            assert server.poll(10_000) and server.recv() == b"hello"
        else:  # the connection never completes, so a message cannot even be queued for it
            with pytest.raises(zmq.Again):
                client.send(b"hello", zmq.NOBLOCK)
    finally:
        client.disable_monitor()
        for sock in (monitor, client, server):
            sock.close(0)
        ctx.term()


def test_check_hello():
    ok = dict(dp_size=4, first_remote_rank=2, tp_size=2, model_name="llama", taken=set())
    assert check_hello(NodeHello(4, 2, 2, 2, "llama"), **ok) is None
    assert "--dp 4" in check_hello(NodeHello(3, 2, 1, 2, "llama"), **ok)
    assert "--tp 2" in check_hello(NodeHello(4, 2, 2, 1, "llama"), **ok)
    assert "model" in check_hello(NodeHello(4, 2, 2, 2, "other"), **ok)
    assert "not remote ranks" in check_hello(NodeHello(4, 1, 2, 2, "llama"), **ok)  # rank 1 is the front end's
    assert "not remote ranks" in check_hello(NodeHello(4, 3, 2, 2, "llama"), **ok)  # rank 4 does not exist
    assert "already have a node" in check_hello(NodeHello(4, 3, 1, 2, "llama"), **{**ok, "taken": {3}})
