"""What an observer of the ZMQ side channels sees, for the attacker tests (test-only; enabled by
SGLANG_HARDEN_TESTBED_WIRETAP_DIR, vanilla servers included).

Two kinds of JSON lines, in ``$SGLANG_HARDEN_TESTBED_WIRETAP_DIR/wiretap-<pid>.jsonl``:

- ``rank_port``: each KV manager's rank port once it is bound (``role``, ``backend`` class, ``ip``, ``port``) -
  what a port scan of the node finds;
- ``sent``: every multipart message a process sends to a ``tcp://`` endpoint (``to``, ``frames`` as hex, each cut
  at ``MAX_FRAME_BYTES``) - the plaintext a sniffer on the path reads (rooms, session ids, buffer addresses).

Hooks ``CommonKVManager.__init__`` (0.5.x; 0.4.x: Mooncake's own ``MooncakeKVManager.__init__``) and
``zmq.Socket.send_multipart`` (the class every socket subclasses,
so sglang-harden's signing sockets are seen too, their auth frame included). Read-only.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import wrap_methods_once

from sglang_harden._importhook import when_imported

WIRETAP_ENV = "SGLANG_HARDEN_TESTBED_WIRETAP_DIR"
MAX_FRAME_BYTES = 1 << 16
CONN = "sglang.srt.disaggregation.common.conn"
MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"


def _write(record: dict[str, Any]) -> None:
    import json
    from pathlib import Path

    folder = Path(os.environ[WIRETAP_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"wiretap-{os.getpid()}.jsonl").open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def _hex(part: Any) -> str:
    data = part if isinstance(part, bytes) else getattr(part, "bytes", None) or memoryview(part).tobytes()
    return data[:MAX_FRAME_BYTES].hex()


def _wrap_init(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        mode = getattr(self, "disaggregation_mode", None)
        _write({"event": "rank_port", "role": str(getattr(mode, "value", mode)), "backend": type(self).__name__,
                "ip": self.local_ip, "port": int(self.rank_port), "pid": os.getpid()})
        return result

    return init


def _wrap_send(original: Any) -> Any:
    @functools.wraps(original)
    def send_multipart(self: Any, msg_parts: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            import zmq

            endpoint = self.getsockopt(zmq.LAST_ENDPOINT).decode()
            if endpoint.startswith("tcp://"):
                parts = list(msg_parts)
                msg_parts = parts
                _write({"event": "sent", "to": endpoint, "pid": os.getpid(), "frames": [_hex(p) for p in parts]})
        except Exception:  # noqa: BLE001 - a tap never changes what is sent
            pass
        return original(self, msg_parts, *args, **kwargs)

    return send_multipart


def _patch_conn(module: ModuleType) -> None:
    wrap_methods_once(module.CommonKVManager, "_sglang_harden_wiretap", {"__init__": _wrap_init})


def _patch_mooncake(module: ModuleType) -> None:
    manager = module.MooncakeKVManager
    if all(cls.__name__ != "CommonKVManager" for cls in manager.__mro__):  # 0.4.x: a manager of its own
        wrap_methods_once(manager, "_sglang_harden_wiretap", {"__init__": _wrap_init})


def _patch_zmq(module: ModuleType) -> None:
    wrap_methods_once(module.Socket, "_sglang_harden_wiretap", {"send_multipart": _wrap_send})


def install() -> None:
    when_imported(CONN, _patch_conn)
    when_imported(MOONCAKE, _patch_mooncake)
    when_imported("zmq", _patch_zmq)
