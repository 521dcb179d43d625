"""Decode's request for prefill's drain acknowledgement: prefill acknowledges that a room's writes drained only
after decode's abort notice for that room, so a room whose pages go to quarantine must have had one sent. Shared by
the plugin's lifecycle (``compat/lifecycle_nodes.py``) and the backport series' ``pd_lifecycle`` (bundled into it).
"""

from __future__ import annotations

from typing import Any


def send_abort_notice(receiver: Any) -> None:
    """Make sure the abort notice of ``receiver``'s room went out (once); raises what SGLang raised."""
    if receiver is None or getattr(receiver, "abort_notified", True):
        return
    ensure = getattr(receiver, "ensure_abort_notified", None)  # 0.5.21+: also arms drain-ack accounting
    if ensure is not None:
        ensure(force_arm=True)
    elif getattr(receiver, "bootstrap_infos", None):
        receiver._send_abort_notification()
        receiver.abort_notified = True
