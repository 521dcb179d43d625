"""The MORI backend's lifecycle hooks (SGLang 0.5.22+, the releases whose MORI acknowledges drains).

MORI posts RDMA writes and polls their statuses. With deferred decode KV release (which the lifecycle guard turns
on) it answers a decode abort notice only once every status of the room's chunks has left InProgress, on the
transfer worker or on its drainer thread. What the hooks add:

* the receiver and ``add_transfer_request`` feed the ledgers, as on every backend;
* a status that ended Failed says nothing about what the write may still put into decode's pages, so the room
  becomes a failed write here *before* its chunk is marked quiescent: its drain ack and its source pages wait for
  ``transfer_write_lifetime_s`` (0.5.22 acks such a room at once; 0.5.23 "poisons" it and never acks);
* a submission that raised may have posted part of the chunk: a failed write too;
* an abort notice for a room whose write failed keeps its ack target (0.5.23 drops it for a poisoned room), and
  the ack goes out once the lifetime passed.

MORI transfers are not windowed. Releases before 0.5.22 have no drain ack on MORI and none of the methods below
but the first two: the guard refuses to start there, naming the hook it misses. MORI cannot run on the CPU
testbed (RDMA, ROCm): ``tests/integration/test_mori_inprocess.py`` drives the real ``mori/conn.py`` of the pin
with a stand-in ``mori`` package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sglang_harden.compat import lifecycle_v05
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import MORI
from sglang_harden.compat.prefill_node import PrefillNode

Func = lifecycle_v05.Func


def _prefill_node(mgr: Any) -> PrefillNode | None:
    node = lifecycle_v05.NODE
    if not isinstance(node, PrefillNode):
        return None
    node.kv_mgr = node.kv_mgr or mgr
    return node


def _note_failed_statuses(mgr: Any, room: int, statuses: Sequence[Any]) -> None:
    node = _prefill_node(mgr)
    if node is not None and any(status.Failed() for status in statuses):
        node.note_failed_write([int(room)])


def _failed_status_on_worker(original: Func) -> Func:
    """The worker waited on a chunk's statuses; a quiescent chunk goes on to be marked so (and acked) after this."""

    def wait_for_chunk_completion(self: Any, kv_chunk: Any, statuses: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, kv_chunk, statuses, *args, **kwargs)
        _note_failed_statuses(self, kv_chunk.room, statuses)
        return result

    return wait_for_chunk_completion


def _failed_status_on_drainer(original: Func) -> Func:
    """The drainer waits for the chunk's statuses and marks it quiescent in one call: wait here first (the call
    then finds none in progress) so that a Failed status is known before the ack."""

    def drain_transfer_statuses(self: Any, kv_chunk: Any, statuses: Any, *args: Any, **kwargs: Any) -> Any:
        for status in statuses:
            if status.InProgress():
                status.Wait()
        _note_failed_statuses(self, kv_chunk.room, statuses)
        return original(self, kv_chunk, statuses, *args, **kwargs)

    return drain_transfer_statuses


def _failed_submission(original: Func) -> Func:
    def handle_submission_failure(self: Any, kv_chunk: Any, exc: Any, *args: Any, **kwargs: Any) -> Any:
        node = _prefill_node(self)
        if node is not None:
            node.note_failed_write([int(kv_chunk.room)])
        return original(self, kv_chunk, exc, *args, **kwargs)

    return handle_submission_failure


def _keep_target_of_failed_write(original: Func) -> Func:
    def arm_abort_ack(self: Any, bootstrap_room: int, notification: Any, *args: Any, **kwargs: Any) -> Any:
        node = _prefill_node(self)
        target = notification.deferred_ack_target() if node is not None else None
        if node is not None and target is not None and node.write_failed(int(bootstrap_room)):
            node.keep_ack_target(int(bootstrap_room), {(target.ip, target.port): target})
        return original(self, bootstrap_room, notification, *args, **kwargs)

    return arm_abort_ack


MODULE = MORI
RECEIVER = "MoriKVReceiver"
MANAGER = "MoriKVManager"
HOOKS: list[Hook] = [
    Hook("lifecycle", MORI, f"{RECEIVER}.send_metadata", ("self", "kv_indices"), lifecycle_v05._send_metadata),
    Hook("lifecycle", MORI, f"{MANAGER}.add_transfer_request", ("self", "bootstrap_room", "kv_indices"),
         lifecycle_v05._hold_sources),
    Hook("lifecycle", MORI, f"{MANAGER}._wait_for_chunk_completion", ("self", "kv_chunk", "statuses"),
         _failed_status_on_worker),
    Hook("lifecycle", MORI, f"{MANAGER}._drain_transfer_statuses", ("self", "kv_chunk", "statuses"),
         _failed_status_on_drainer),
    Hook("lifecycle", MORI, f"{MANAGER}._handle_submission_failure", ("self", "kv_chunk", "exc"),
         _failed_submission),
    Hook("lifecycle", MORI, f"{MANAGER}._arm_abort_ack", ("self", "bootstrap_room", "notification"),
         _keep_target_of_failed_write),
]
