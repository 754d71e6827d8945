"""A step's integer inputs sent to the device in one copy (the GPU path).

A step's forward pass indexes with a handful of small int64 tensors built on the host:
token ids, positions, slots, the block table, the decode rows' lengths. Sent one by one
from pageable memory, each ``.to(device)`` is a copy the host waits for; on a GPU those
waits were a large part of a small model's step (docs/cuda.md). Here they are packed
into one pinned host buffer, sent in one non-blocking copy, and handed back as views of
one device buffer, in the shapes they came in.

Both buffers grow and are reused. The device buffer may be rewritten by the next step's
copy while nothing reads it any more: the copy and the kernels that read the last step's
views are on the same stream, so the copy waits for them. The host buffer is rewritten
only once the last copy has read it (an event recorded after each copy).
"""

from __future__ import annotations

from typing import Sequence

import torch


class StepInputs:
    def __init__(self, device: torch.device) -> None:
        """``device``: where the views are wanted. On a CUDA device the host side is
        pinned; elsewhere (the tests on a CPU) the same packing and views, plain copies."""
        self.device = device
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.long)
        self._dev = torch.empty(0, dtype=torch.long, device=device)
        self._copied = torch.cuda.Event() if self._pin else None
        self.copies = 0  # copies made (the tests read it)

    def send(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The device copies of ``tensors`` (int64 host tensors, any shape; None passes
        through), after one copy. A view returned stays valid until the next call."""
        present = [t for t in tensors if t is not None]
        if any(t.dtype != torch.long for t in present):
            raise TypeError("StepInputs packs int64 tensors only")
        total = sum(t.numel() for t in present)
        if self._copied is not None:
            self._copied.synchronize()  # the last copy is done with the host buffer
        if total > self._host.numel():
            size = max(total, 2 * self._host.numel(), 1024)
            self._host = torch.empty(size, dtype=torch.long, pin_memory=self._pin)
            self._dev = torch.empty(size, dtype=torch.long, device=self.device)
        offset = 0
        spans = []
        for t in present:
            n = t.numel()
            self._host[offset : offset + n].view(t.shape).copy_(t)
            spans.append((offset, n, t.shape))
            offset += n
        self._dev[:offset].copy_(self._host[:offset], non_blocking=self._pin)
        if self._copied is not None:
            self._copied.record()
        self.copies += 1
        views = iter([self._dev[a : a + n].view(shape) for a, n, shape in spans])
        return [None if t is None else next(views) for t in tensors]
