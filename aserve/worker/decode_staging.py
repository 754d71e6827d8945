"""Dense copies of the keys and values of decoding requests: the plain-torch CPU decode
path, used where the C kernel (:mod:`aserve.kernels.cpu_decode_attention`) is not.

Attention over a paged cache must first gather each request's blocks into one tensor.
On a GPU a kernel reads the blocks in place; in plain torch on a CPU the gather copies
every key and value of every running request, in every layer, at every step, which
costs more than the attention itself. So each decoding request also gets a row in a
dense buffer per layer::

    keys[layer]: [rows, kv_heads, max_len, head_dim]     (values alike)

A row is filled once from the paged cache when its request starts decoding, then grows
by the one token each step writes. The paged cache stays the source of truth (prefix
caching and preemption use it); a row is dropped when its request finishes or is
preempted, and the last row moves into the hole so rows ``0 .. n-1`` stay packed and
a step whose decoding requests are exactly those rows attends over a view, not a copy.
"""

from __future__ import annotations

import torch

from aserve.kernels.attention import gather_blocks


class DecodeStaging:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self._shape = (num_kv_heads, head_dim)
        self._dtype = dtype
        self.keys = [self._empty(0, 0) for _ in range(num_layers)]
        self.values = [self._empty(0, 0) for _ in range(num_layers)]
        self.row_of: dict[str, int] = {}
        self._req_at: list[str] = []
        self._lengths: list[int] = []

    def _empty(self, rows: int, length: int) -> torch.Tensor:
        heads, dim = self._shape
        return torch.zeros(rows, heads, length, dim, dtype=self._dtype)

    @property
    def num_rows(self) -> int:
        return len(self._req_at)

    def write_index(self, rows: list[int], positions: list[int]) -> torch.Tensor:
        """Indices into ``buffer.view(-1, head_dim)`` of the (row, head, position) slots
        this step writes, ordered [token, head] like the step's keys."""
        heads, length = self.keys[0].shape[1], self.keys[0].shape[2]
        base = torch.tensor(rows).unsqueeze(1) * heads + torch.arange(heads)  # [N, H]
        return (base * length + torch.tensor(positions).unsqueeze(1)).reshape(-1)

    def release(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = len(self._req_at) - 1
        if row != last:
            moved = self._req_at[last]
            n = self._lengths[last]
            for buf in (*self.keys, *self.values):
                buf[row, :, :n] = buf[last, :, :n]
            self._req_at[row], self._lengths[row] = moved, n
            self.row_of[moved] = row
        self._req_at.pop()
        self._lengths.pop()

    def _ensure_capacity(self, rows: int, length: int) -> None:
        cap_rows, cap_len = self.keys[0].shape[0], self.keys[0].shape[2]
        if rows <= cap_rows and length <= cap_len:
            return
        new_rows = max(rows, cap_rows * 2 if rows > cap_rows else cap_rows, 8)
        new_len = max(length, cap_len * 2 if length > cap_len else cap_len, 64)
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = self._empty(new_rows, new_len)
                new[:cap_rows, :, :cap_len] = old
                bufs[i] = new

    def prepare(
        self, reqs: list[tuple[str, list[int], int]], paged: list[torch.Tensor], block_size: int
    ) -> list[int]:
        """Rows for this step's decoding requests ``(req_id, block_ids, context_len)``.

        A request without a row (or whose row is out of date) gets one, filled from
        the paged cache's first ``context_len`` tokens. Each row then has room for the
        token this step writes at position ``context_len``.
        """
        self._ensure_capacity(len(self._req_at) + sum(1 for r in reqs if r[0] not in self.row_of),
                              max(ctx for _, _, ctx in reqs) + 1)
        rows = []
        for req_id, block_ids, ctx in reqs:
            row = self.row_of.get(req_id)
            if row is None:
                row = len(self._req_at)
                self._req_at.append(req_id)
                self._lengths.append(-1)
                self.row_of[req_id] = row
            if self._lengths[row] != ctx:
                ids = torch.tensor(block_ids[: -(-ctx // block_size)], dtype=torch.long)
                for layer, cache in enumerate(paged):
                    self.keys[layer][row, :, :ctx] = gather_blocks(cache[0], ids)[:ctx].transpose(0, 1)
                    self.values[layer][row, :, :ctx] = gather_blocks(cache[1], ids)[:ctx].transpose(0, 1)
            self._lengths[row] = ctx + 1
            rows.append(row)
        return rows
