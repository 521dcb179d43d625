"""Prefill's per-room record (:class:`SourceRoom`, kept by :class:`PrefillNode`): one record per unsettled room,
changed by several threads under one lock, dropped once empty."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np

from sglang_harden.compat.prefill_node import PrefillNode
from sglang_harden.config import Mode

ROOM = 5


def _node() -> PrefillNode:
    node = PrefillNode.for_allocator(SimpleNamespace(size=64, page_size=1))
    node.lifetime_s = 30.0
    return node


def test_one_record_per_room_dropped_once_settled() -> None:
    node = _node()
    node.hold(None, ROOM, np.arange(4, dtype=np.int64))
    node.hold(None, ROOM, np.arange(4, 8, dtype=np.int64))
    assert list(node.rooms) == [ROOM] and len(node.rooms[ROOM].sources) == 2
    assert not node.busy(), "a room being read needs nothing from the settle step"
    assert node.keep_back(np.arange(8, dtype=np.int64), Mode.ENFORCE) is None  # no kv_mgr: nothing in flight
    assert node.rooms == {} and not node.held_room.any()


def test_pages_kept_back_are_freed_by_the_settle_step_with_the_acks() -> None:
    node = _node()
    mgr = SimpleNamespace(request_status={}, _staging_outstanding={ROOM: 1})
    node.hold(mgr, ROOM, np.arange(4, dtype=np.int64))
    kept = node.keep_back(np.arange(4, dtype=np.int64), Mode.ENFORCE)
    assert kept is not None and kept.all()
    acks: list[str] = []
    node.stash_ack(ROOM, lambda: acks.append("ack"))
    assert node.busy() and node.settle_pending() == [] and acks == []
    mgr._staging_outstanding[ROOM] = 0
    assert sorted(node.settle_pending()) == [0, 1, 2, 3] and acks == ["ack"]
    assert node.rooms == {} and not node.busy()


def test_a_failure_marked_after_the_record_went_is_not_lost() -> None:
    node = _node()
    node.hold(None, ROOM, np.arange(2, dtype=np.int64))
    node._settle(ROOM)
    assert ROOM not in node.rooms
    node.note_failed_write([ROOM])  # a transfer worker, just after the scheduler dropped the record
    assert node.write_failed(ROOM) and node.busy()


def test_forgetting_an_expired_failure_keeps_a_newer_one() -> None:
    node = _node()
    node.note_failed_write([ROOM])
    old = node.rooms[ROOM].failed_at
    assert old is not None
    time.sleep(0.001)
    node.note_failed_write([ROOM])  # a second write of the room failed meanwhile
    node._forget_failure(ROOM, old)
    assert node.write_failed(ROOM), "the newer failure still holds the room"


def test_a_mark_racing_the_records_removal_is_not_lost() -> None:
    """A transfer worker marks a failure while the scheduler drops the room's record as settled: the removal waits
    for the mark (one lock), sees the record is not empty and keeps it. Were the mark made outside the lock, the
    scheduler would drop the record first and the mark would land in a record nobody holds."""
    node = _node()
    node.hold(None, ROOM, np.arange(2, dtype=np.int64))
    marking, release = threading.Event(), threading.Event()

    def slow_mark(record: object) -> None:
        marking.set()
        release.wait(2.0)
        record.failed_at = time.monotonic()  # type: ignore[attr-defined]

    worker = threading.Thread(target=node._change, args=(ROOM, slow_mark))
    worker.start()
    assert marking.wait(2.0)
    scheduler = threading.Thread(target=node._settle, args=(ROOM,))
    scheduler.start()
    scheduler.join(0.2)
    release.set()
    worker.join()
    scheduler.join()
    assert node.write_failed(ROOM) and node.busy()
