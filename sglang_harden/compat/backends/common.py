"""What two backends share: reading a decode abort notice whose drain-ack target SGLang is about to drop, and the
rooms a transfer worker has in flight (the ones a failed write belongs to)."""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Sequence
from typing import Any

from sglang_harden.compat import lifecycle_v05
from sglang_harden.compat.internals import backend_module
from sglang_harden.compat.lifecycle_nodes import _kv_poll
from sglang_harden.compat.prefill_node import PrefillNode

# The branch of a backend's abort-notice handler (prefill) that answers a notice for a room already concluded
# (Success, or cleared) with a drain ack only when no chunk of the room is counted in flight, and has no else: no ack
# then, and no target kept for the worker to ack later, so decode's quarantine of the room never ends. Releases
# without it keep the target whenever a chunk is still counted.
DROPPING_BRANCH = "elif self._staging_outstanding.get(room_to_be_aborted, 0) == 0:"
_drops_ack: dict[str, bool] = {}
ABORT_TAG = b"ABORT"
logger = logging.getLogger("sglang_harden")


def note_abort_notice(mgr: Any, backend: str, msg: Sequence[bytes]) -> None:
    """Keep the drain-ack target of an abort notice SGLang is about to drop (see :data:`DROPPING_BRANCH`); the
    ack goes out once the room settled (:meth:`PrefillNode.settle_pending`)."""
    node = lifecycle_v05.NODE
    if not isinstance(node, PrefillNode) or not drops_ack_of_concluded_room(backend):
        return
    notice = _abort_notice(msg)
    if notice is None or not getattr(mgr, "enable_deferred_decode_kv_release", False):
        return
    room, decode_ip, decode_port = notice
    concluded = room not in mgr.request_status or mgr.check_status(room) == _kv_poll().success
    if concluded and mgr._staging_outstanding.get(room, 0) > 0:
        node.kv_mgr = node.kv_mgr or mgr
        node.keep_ack_target(room, (decode_ip, decode_port))


def drops_ack_of_concluded_room(backend: str) -> bool:
    """Whether this release's ``backend`` handler has :data:`DROPPING_BRANCH` (read from its code once). Code that
    cannot be read counts as dropping: the guard then keeps the target itself, and a second ack of a drained room
    is harmless where a missing one holds decode's pages for good."""
    if backend not in _drops_ack:
        module = sys.modules.get(backend_module(backend))
        if module is None:
            return True  # not imported yet: decide (and remember) once it is
        try:
            _drops_ack[backend] = DROPPING_BRANCH in inspect.getsource(module)
        except (OSError, TypeError) as exc:
            logger.warning("sglang-harden lifecycle: %s's source is not readable (%r); keeping the drain-ack target "
                           "of every concluded room with a chunk in flight", module.__name__, exc)
            _drops_ack[backend] = True
    return _drops_ack[backend]


def _abort_notice(msg: Sequence[bytes]) -> tuple[int, str, int] | None:
    """(room, decode ip, decode port) of a decode abort notice carrying its ack target; None for anything else."""
    if len(msg) < 4 or msg[0] != ABORT_TAG:
        return None
    try:
        return int(msg[1].decode("ascii")), msg[2].decode("ascii"), int(msg[3].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None  # SGLang logs and drops a malformed notice itself


def rooms_in_flight(mgr: Any, session: str) -> list[int]:
    """Rooms of ``session`` with a chunk dequeued by a transfer worker right now (the one whose write failed).
    ``session``: Mooncake's session id or NIXL's peer agent name (both key a room's ``transfer_infos``)."""
    outstanding = getattr(mgr, "_staging_outstanding", {})
    return [room for room, infos in list(mgr.transfer_infos.items())
            if session in infos and outstanding.get(room, 0) > 0]


# Pins (per backend) whose prefill answers a decode abort notice for a room that already concluded (Success, or
# cleared) with a drain ack only when no chunk of the room is counted in flight, and otherwise with nothing: no ack
# then, and no target kept for the worker to ack later, so decode's quarantine of the room never ends. Later pins
# keep the target whenever a chunk is still counted.
