"""The NIXL backend's lifecycle hooks: its receiver and manager feed the ledgers, a failed post marks the rooms in
flight as failed writes, and on pins that drop the ack target of an abort notice for a concluded room, the target
is kept. NIXL transfers are not windowed."""

from __future__ import annotations

from typing import Any

from sglang_harden.compat import lifecycle_v05
from sglang_harden.compat.backends.common import note_abort_notice, rooms_in_flight
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import NIXL
from sglang_harden.compat.prefill_node import PrefillNode

Func = lifecycle_v05.Func


def _nixl_send_kvcache(original: Func) -> Func:
    """NIXL raises when the post of a KV transfer fails; the request may have been posted in part, so its bytes
    may still land in decode's pages (0.5.23 says so itself and poisons the room's drain ack, but NIXL rooms were
    never marked as failed writes here, so decode's quarantine had no way out)."""

    def send_kvcache(self: Any, peer_name: str, prefill_kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, peer_name, prefill_kv_indices, *args, **kwargs)
        except Exception:
            node = lifecycle_v05.NODE
            if isinstance(node, PrefillNode):
                node.kv_mgr = node.kv_mgr or self
                node.note_failed_write(rooms_in_flight(self, peer_name))
            raise

    return send_kvcache


def _nixl_abort_notice(original: Func) -> Func:
    def handle_abort_notification(self: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
        note_abort_notice(self, "nixl", msg)
        return original(self, msg, *args, **kwargs)

    return handle_abort_notification


MODULE = NIXL
RECEIVER = "NixlKVReceiver"
HOOKS: list[Hook] = [
    Hook("lifecycle", NIXL, f"{RECEIVER}.send_metadata", ("self", "kv_indices"), lifecycle_v05._send_metadata),
    Hook("lifecycle", NIXL, "NixlKVManager.add_transfer_request", ("self", "bootstrap_room", "kv_indices"),
         lifecycle_v05._hold_sources),
    Hook("lifecycle", NIXL, "NixlKVManager.send_kvcache", ("self", "peer_name", "prefill_kv_indices"),
         _nixl_send_kvcache),
    Hook("lifecycle", NIXL, "NixlKVManager._handle_abort_notification", ("self", "msg"), _nixl_abort_notice),
]
