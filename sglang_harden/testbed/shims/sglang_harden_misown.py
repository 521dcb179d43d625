"""Test hook (test-only): deliberately mis-own one KV page. Enabled by SGLANG_HARDEN_TESTBED_MISOWN_ROOM.

``SGLANG_HARDEN_TESTBED_MISOWN_ROOM=<room>``: in a hardened decode server, right after the transfer of that
bootstrap room completes, one page of the request's page table is handed to another owner in the decode
ledger (what a page reused under a late foreign write would look like). The page-tag check at the commit must
then abort the request (HTTP 500, "page ownership") instead of generating.

Wraps ``sglang_harden.compat.lifecycle_v05.DecodeNode.finish``; a vanilla server has no ledger and ignores it.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from sglang_harden._importhook import when_imported

ENV = "SGLANG_HARDEN_TESTBED_MISOWN_ROOM"


def _patch(module: ModuleType) -> None:
    cls = module.DecodeNode
    if getattr(cls, "_sglang_harden_misown", False):
        return
    room_to_tamper = int(os.environ[ENV])
    original = cls.finish

    def finish(self: Any, room: int) -> Any:
        transfer = original(self, room)
        if transfer is not None and int(room) == room_to_tamper and len(transfer.pages):
            page = int(transfer.pages[len(transfer.pages) // 2])
            self.ledger.release(transfer.owner, [page], writer_drained=True)
            self.ledger.reserve("room:intruder", [page])
        return transfer

    cls.finish = finish
    cls._sglang_harden_misown = True


def install() -> None:
    when_imported("sglang_harden.compat.lifecycle_v05", _patch)
