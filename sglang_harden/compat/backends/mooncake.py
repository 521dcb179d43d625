"""The Mooncake backend's lifecycle hooks: its receiver and manager feed the ledgers, a failed engine call marks
the rooms in flight as failed writes, each transfer is cut into bounded windows on pins without SGLang's own
setting, and on pins whose listener thread drops the ack target of an abort notice, the target is kept."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from sglang_harden import events
from sglang_harden.compat import lifecycle_v05
from sglang_harden.compat.backends.common import drops_ack_of_concluded_room, note_abort_notice, rooms_in_flight
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import MOONCAKE
from sglang_harden.compat.lifecycle_nodes import _kv_poll
from sglang_harden.compat.prefill_node import PrefillNode
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import lifecycle
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

Func = lifecycle_v05.Func


def _send_kvcache(original: Func) -> Func:
    """Bounded transfer window (pins without the env) and failed-write tracking (every pin)."""

    def send_kvcache(self: Any, mooncake_session_id: str, prefill_kv_indices: Any, dst_kv_ptrs: Any,
                     dst_kv_indices: Any, executor: Any, *args: Any, **kwargs: Any) -> Any:
        status = _send_windows(original, self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                               dst_kv_indices, executor, *args, **kwargs)
        node = lifecycle_v05.NODE
        if status != 0 and isinstance(node, PrefillNode):
            node.note_failed_write(rooms_in_flight(self, mooncake_session_id))
        return status

    return send_kvcache


def _send_windows(original: Func, mgr: Any, session: str, src: Any, ptrs: Any, dst: Any, executor: Any,
                  *args: Any, **kwargs: Any) -> Any:
    window = RUNTIME.config.transfer_window_pages
    if window <= 0 or hasattr(mgr, "max_transfer_batch_indices") or len(src) <= window:
        return original(mgr, session, src, ptrs, dst, executor, *args, **kwargs)
    for start in range(0, len(src), window):
        end = start + window
        status = original(mgr, session, src[start:end], ptrs, dst[start:end], executor, *args, **kwargs)
        if status != 0:
            return status
    return 0


class _NoticeWatchingSocket:
    """Mooncake's prefill bootstrap socket, as its listener thread reads it (on releases with the dropping branch,
    ``common.DROPPING_BRANCH``, the thread handles abort notices inline, with no method to hook)."""

    def __init__(self, socket: Any, mgr: Any):
        self._socket, self._mgr = socket, mgr

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        msg = self._socket.recv_multipart(*args, **kwargs)
        note_abort_notice(self._mgr, "mooncake", msg)
        return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def _mooncake_abort_notices(original: Func) -> Func:
    def start_prefill_thread(self: Any, *args: Any, **kwargs: Any) -> Any:
        if drops_ack_of_concluded_room("mooncake") and not isinstance(self.server_socket, _NoticeWatchingSocket):
            self.server_socket = _NoticeWatchingSocket(self.server_socket, self)
        return original(self, *args, **kwargs)

    return start_prefill_thread


def _failure_with_drain_evidence(original: Func) -> Func:
    """0.5.19's transfer worker fails every room queued for a decode session it has just marked failed, without
    writing anything of them. Decode cannot tell those rooms from the one whose write failed, so it quarantined
    all of them until a drain ack came back (a dozen rooms at once on a busy node). The worker that fails a room
    with no write of it in flight now sends the drain ack first, on the same socket as the failure, so decode
    frees the pages at once; a room whose write failed gets no ack here (its ack waits for the write lifetime)."""

    def sync_status(self: Any, remote: str, dst_port: int, room: int, status: int, *args: Any, **kwargs: Any) -> Any:
        node = lifecycle_v05.NODE
        if (isinstance(node, PrefillNode) and status == _kv_poll().failed and not getattr(self, "enable_staging", False)
                and node.failed_without_write_in_flight(int(room))):
            _send_drain_evidence(self, remote, dst_port, int(room))
        return original(self, remote, dst_port, room, status, *args, **kwargs)

    return sync_status


def _send_drain_evidence(mgr: Any, decode_ip: str, decode_port: int, room: int) -> None:
    """SGLang's own drain ack, past :func:`_withhold_ack` (which waits for the worker's chunk to be counted
    done: the worker sending this is that chunk, and it wrote nothing)."""
    send_ack = inspect.unwrap(type(mgr)._send_abort_ack)
    try:
        send_ack(mgr, decode_ip, decode_port, room)
    except Exception as exc:  # noqa: BLE001 - decode then quarantines the pages and asks for the ack itself
        logger.warning("sglang-harden lifecycle: drain ack with the failure of room %s not sent: %r", room, exc)
        return
    events.record(Decision(lifecycle.GUARD, Verdict.RELEASE, "room failed with no write of it in flight: drain "
                           "ack sent with the failure", None, {"room": room}), Mode.ENFORCE)


MODULE = MOONCAKE
RECEIVER = "MooncakeKVReceiver"
HOOKS: list[Hook] = [
    Hook("lifecycle", MOONCAKE, f"{RECEIVER}.send_metadata", ("self", "kv_indices"), lifecycle_v05._send_metadata),
    Hook("lifecycle", MOONCAKE, "MooncakeKVManager.add_transfer_request", ("self", "bootstrap_room", "kv_indices"),
         lifecycle_v05._hold_sources),
    Hook("lifecycle", MOONCAKE, "MooncakeKVManager.send_kvcache",
         ("self", "mooncake_session_id", "prefill_kv_indices", "dst_kv_ptrs", "dst_kv_indices", "executor"),
         _send_kvcache),
    Hook("lifecycle", MOONCAKE, "MooncakeKVManager.start_prefill_thread", ("self",), _mooncake_abort_notices),
    # Releases whose Mooncake transfer worker tells decode of a room's status itself, one endpoint at a time, have
    # this (later ones conclude a room through CommonKVManager).
    Hook("lifecycle", MOONCAKE, "MooncakeKVManager.sync_status_to_decode_endpoint",
         ("self", "remote", "dst_port", "room", "status"), _failure_with_drain_evidence, optional=True),
]
