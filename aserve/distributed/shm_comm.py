"""All-reduce and all-gather between the tensor-parallel ranks of one node, through
shared memory (the CPU data path of docs/design.md §6; decision in ``docs/parallelism.md``).

Why not gloo: on this machine a gloo all-reduce of one 256-wide bf16 row between two
processes takes ~2 ms over loopback TCP, and a TP = 2 step of a 4-layer model runs nine
of them. Gloo also keeps a thread per process that wakes every 10 ms for as long as the
process group exists, which was most of an idle server's CPU. Here a collective is a
copy into shared memory, a wait on the peers' sequence words and a read of their
slots (``cpu_shm_collectives.c`` has the protocol); an idle rank has no thread at all.

Set-up goes through ``torch.distributed`` (the caller's gloo group provides the
barriers): rank 0 creates ``/dev/shm/<name>``, every rank maps it and writes its pid,
and rank 0 unlinks the file once all have mapped it, so nothing is left behind even
if a rank is killed later. The caller then releases its gloo group.

A collective that waits for a peer returns to Python every ``BLOCK_US``: signals are
handled there (a worker's SIGTERM still stops it), and a peer that has exited raises
:class:`TPPeerLostError` instead of hanging the step.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from aserve.kernels.cbuild import load_library

_SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "cpu_shm_collectives.c"
_LINE = 64
_PID = struct.Struct("<i")
_PID_OFFSET = 8  # in each rank's line, after seq and waiters
DEFAULT_SLOT_BYTES = 4 << 20  # a prefill's [2048, 1024] bf16 activations in one go
SPIN_US = 100  # ranks of one step arrive microseconds apart
BLOCK_US = 100_000  # how often a blocked wait looks at its peers
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class TPPeerLostError(RuntimeError):
    """A tensor-parallel peer exited while this rank waited for it in a collective."""


def load_collectives(cache_dir: Path) -> ctypes.CDLL | None:
    """The built C library, or None (logged) without a compiler."""
    return load_library(_SOURCE, cache_dir, "shared-memory tensor-parallel collectives")


def segment_bytes(size: int, slot_bytes: int) -> tuple[int, int]:
    """``(data offset, total size)`` of the segment for ``size`` ranks."""
    data_offset = -(-size * _LINE // 4096) * 4096
    return data_offset, data_offset + size * 2 * slot_bytes


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZXx"


class ShmCommunicator:
    """One rank's end of the segment. Every rank must run the same collectives in the
    same order with the same shapes and dtypes (as torch.distributed requires)."""

    def __init__(self, lib: ctypes.CDLL, name: str, rank: int, size: int, barrier: Callable[[], None],
                 slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        if not 0 <= rank < size or size < 2:
            raise ValueError(f"rank {rank} of {size}: a shared-memory group needs 2 or more ranks")
        if slot_bytes <= 0 or slot_bytes % _LINE:
            raise ValueError(f"slot_bytes must be a positive multiple of {_LINE}")
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self._data_offset, total = segment_bytes(size, slot_bytes)
        path = f"/dev/shm/{name}"
        try:
            if rank == 0:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, total)
                os.close(fd)
            barrier()
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, total)
            finally:
                os.close(fd)
            _PID.pack_into(self._map, rank * _LINE + _PID_OFFSET, os.getpid())
            barrier()  # every rank has mapped the file and written its pid
        finally:
            if rank == 0:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        self.peer_pids = {p: _PID.unpack_from(self._map, p * _LINE + _PID_OFFSET)[0] for p in range(size) if p != rank}
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base = self._bytes.data_ptr()
        ptr, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
        self._publish = lib.shm_publish
        self._publish.argtypes = [ptr, i64, i64, i32, ptr, i64]
        self._publish.restype = u32
        self._wait = lib.shm_wait
        self._wait.argtypes = [ptr, i32, i32, u32, i32, i32]
        self._wait.restype = i32
        self._sum = lib.shm_sum
        self._sum.argtypes = [ptr, i64, i64, i32, u32, ptr, i64, i32]
        self._sum.restype = None

    def _exchange(self, src_ptr: int, nbytes: int) -> int:
        """Publish ``nbytes`` at ``src_ptr``, wait for every rank's part; the generation."""
        gen = self._publish(self._base, self._data_offset, self.slot_bytes, self.rank, src_ptr, nbytes)
        spin = SPIN_US
        while self._wait(self._base, self.rank, self.size, gen, spin, BLOCK_US):
            spin = 0
            lost = [f"rank {p} (pid {pid})" for p, pid in self.peer_pids.items() if not _process_alive(pid)]
            if lost:
                raise TPPeerLostError(f"tensor-parallel peer {', '.join(lost)} exited during a collective")
        return gen

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (float32, bfloat16 or float16, on CPU) over the group, in place; the
        sum is taken in rank order in float32, so every rank gets the same bits."""
        code = _DTYPES.get(x.dtype)
        if code is None or x.device.type != "cpu":
            raise TypeError(f"shared-memory all-reduce takes float32/bfloat16/float16 CPU tensors, not {x.dtype} "
                            f"on {x.device}")
        flat = x if x.is_contiguous() else x.contiguous()
        per_chunk = self.slot_bytes // x.element_size()
        total = flat.numel()
        ptr = flat.data_ptr()
        for start in range(0, total, per_chunk):
            n = min(per_chunk, total - start)
            offset = start * x.element_size()
            gen = self._exchange(ptr + offset, n * x.element_size())
            self._sum(self._base, self._data_offset, self.slot_bytes, self.size, gen, ptr + offset, n, code)
        if flat is not x:
            x.copy_(flat)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        x = x.contiguous()
        width = x.shape[-1]
        rows = x.numel() // width if width else 0
        row_bytes = width * x.element_size()
        out = torch.empty(*x.shape[:-1], width * self.size, dtype=x.dtype)
        if rows == 0 or width == 0:
            return out
        if row_bytes > self.slot_bytes:
            raise ValueError(f"a row of {row_bytes} bytes does not fit a {self.slot_bytes}-byte slot")
        src = x.view(rows, width)
        dst = out.view(rows, width * self.size)
        per_chunk = self.slot_bytes // row_bytes
        for start in range(0, rows, per_chunk):
            n = min(per_chunk, rows - start)
            gen = self._exchange(src[start].data_ptr(), n * row_bytes)
            for p in range(self.size):
                at = self._data_offset + (p * 2 + (gen & 1)) * self.slot_bytes
                part = self._bytes[at:at + n * row_bytes].view(x.dtype).view(n, width)
                dst[start:start + n, p * width:(p + 1) * width].copy_(part)
        return out

    def close(self) -> None:
        """Unmap the segment (the file is gone already). The communicator is unusable after."""
        if self._map.closed:
            return
        self._bytes = None
        try:
            self._map.close()
        except BufferError:
            # A view is still alive (say in the traceback of a TPPeerLostError being
            # handled): the mapping goes with the process instead.
            pass
