"""The heartbeat segment's two counters a slot (aserve/process/heartbeat.py): ticks,
written by a process's heartbeat thread, and progress, written by a worker's model
thread after each layer; each has one writer and neither moves the other."""

from __future__ import annotations

import os
import uuid

from aserve.process.heartbeat import HeartbeatMonitor, HeartbeatTable, Progress


def test_progress_and_ticks_are_separate_counters_of_each_slot():
    name = f"aserve_test_{uuid.uuid4().hex[:12]}_heartbeat"
    table = HeartbeatTable(name, 3, create=True)
    try:
        assert os.path.getsize(f"/dev/shm/{name}") == 3 * 16
        monitor = HeartbeatMonitor(table, {0: "a", 1: "b", 2: "c"}, timeout=1.0)
        table.tick(1)
        progress = Progress(table, 1)
        for _ in range(5):
            progress.advance()
        assert [table.progress(s) for s in range(3)] == [0, 5, 0]
        assert [table.read(s) for s in range(3)] == [0, 1, 0]  # progress leaves the ticks alone
        # A worker whose ticks stopped is stale even while its progress counter moved (its
        # model thread is not its heartbeat); one that never ticked is still starting.
        assert monitor.check(0.0) == []
        progress.advance()
        assert monitor.check(1e9) == ["b"]
        # A second handle on the slot (a restarted counter object) goes on from the count.
        other = HeartbeatTable(name, 3, create=False)
        Progress(other, 1).advance()
        other.close()  # not the owner: the segment stays
        assert table.progress(1) == 7
    finally:
        table.close()
    assert not os.path.exists(f"/dev/shm/{name}")
