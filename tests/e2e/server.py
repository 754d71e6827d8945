"""Start ``aserve run`` as a subprocess on a free port and wait until it is ready."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx


class Server:
    def __init__(self, model: Path | None, *extra: str, env: dict[str, str] | None = None, verify: Any = True,
                 wait: bool = True, launcher: tuple[str, ...] = ()) -> None:
        """``model`` None: ``aserve run`` with no model (the default one); ``launcher``:
        words before the command (``private_shm.sh DIR``: a node with its own /dev/shm)."""
        self.verify = verify
        self.model_path = None if model is None else Path(model)
        cmd = [*launcher, sys.executable, "-m", "aserve", "run", *([] if model is None else [str(model)]), "--port", "0",
               "--kv-cache-memory", str(1 << 24), "--max-model-len", "256", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.log: list[str] = []
        self.base_url = ""
        while not self.base_url:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("aserve run exited:\n" + "".join(self.log))
            self.log.append(line)
            match = re.search(r"at (https?://\S+)/v1", line)
            if match:
                self.base_url = match.group(1)
        # Keep reading the server's output so its pipe never fills and blocks it.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def output(self) -> str:
        return "".join(self.log)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/ready", timeout=5, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("aserve run exited while starting")
            time.sleep(0.2)  # a readiness probe, as Kubernetes would poll it
        raise TimeoutError("aserve run did not become ready")

    def pids(self) -> list[int]:
        return [self.proc.pid, *process_tree(self.proc.pid)]

    def titles(self) -> dict[str, int]:
        """Process title -> pid, for the whole tree (one pid per title)."""
        return {title: pid for pid, title in self.title_list()}

    def title_list(self) -> list[tuple[int, str]]:
        """(pid, title) of every process of the tree."""
        out = []
        for pid in self.pids():
            try:
                out.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()))
            except FileNotFoundError:
                pass
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(10)
            self.proc.stdout.close()
        return code


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def aserve_shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("aserve_*")}


def aserve_dirs() -> set[str]:
    """Instance directories (IPC sockets) of aserve servers in the temporary directory."""
    import tempfile

    return {p.name for p in Path(tempfile.gettempdir()).glob("aserve_*-*")}


def process_tree(pid: int) -> list[int]:
    """Every descendant of ``pid`` (not ``pid`` itself), depth first."""
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return [k for c in kids for k in (c, *process_tree(c))]


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 all free now (an engine across nodes binds its
    rendezvous at P and its calls and replies at P + 1 and P + 2)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 65535 - count:
            continue
        socks = [socket.socket() for _ in range(count)]
        try:
            for i, sock in enumerate(socks):
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")
