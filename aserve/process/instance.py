"""One server instance's names on this machine, and their removal.

Every shared-memory segment an instance creates is ``/dev/shm/<id>_<name>`` and every
IPC socket file lives in its private directory (mode 0700, which is what protects the
``ipc://`` wires on one machine). Whoever creates the instance (the ``aserve run``
supervisor, a headless node, an ``AsyncLLM`` or ``LLM`` that owns its processes) calls
:meth:`Instance.cleanup` on every exit path it survives; an engine core orphaned by its
supervisor does it instead (``aserve.engine.core_process``).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Instance:
    id: str  # "aserve_<12 hex digits>": the prefix of every segment
    dir: str | None  # private temporary directory of the IPC files (None: the instance has none)

    @classmethod
    def create(cls, *, ipc: bool = True) -> Instance:
        """A new instance; ``ipc=False`` for one that only names segments (a headless
        node's workers), so that no directory is made: a directory is left behind when
        its owner is killed with SIGKILL and no orphan of it removes it."""
        instance_id = f"aserve_{uuid.uuid4().hex[:12]}"
        return cls(instance_id, tempfile.mkdtemp(prefix=f"{instance_id}-") if ipc else None)

    def segment(self, name: str) -> str:
        """The name of this instance's shared-memory segment ``name`` (no ``/dev/shm/``)."""
        return f"{self.id}_{name}"

    def ipc(self, name: str) -> str:
        """The ``ipc://`` address of this instance's socket file ``name``."""
        if self.dir is None:
            raise ValueError(f"instance {self.id} was created without an IPC directory")
        return f"ipc://{self.dir}/{name}"

    def cleanup(self) -> None:
        """Remove every shared-memory segment and IPC file of the instance; idempotent."""
        for path in glob.glob(f"/dev/shm/{self.id}_*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
