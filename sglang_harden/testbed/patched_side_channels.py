"""SGLang's real Mooncake prefill listener behind a patched or a vanilla rank port, for tests (plugin off).

    SGLANG_HARDEN_ACTIVATE=0 <pin venv python> -m sglang_harden.testbed.patched_side_channels TREE|- [--role-switch]

``TREE`` holds only the files a backport series touches (patched; ``-``: the venv's own SGLang, vanilla). A
``MooncakeKVManager`` is built without its ``__init__`` (no transfer engine, no bootstrap server): its rank port is
bound by SGLang's ``get_zmq_socket_on_host`` on loopback and, patched, handed to ``pd_side_channels.guard_rank_port``
(the call the series puts right after that bind; on 0.4.x SGLang's own ``start_prefill_thread`` binds it, through
the patched ``_bind_server_socket``); then SGLang's own ``start_prefill_thread`` runs the real listener loop
(started, patched, under ``restarting_listener``). Decode's side is SGLang's ``MooncakeKVReceiver._connect``
(signing, patched). Releases before 0.5.18 ("early": no ``_send_multipart_locked``) have no wire rules in their
series and no socket cache to cap; their registration has no state frame on 0.4.x, and the page-lifecycle patch's own
drain acknowledgement (``SGH_ABORT_ACK``) is checked for its auth frame too. Every observation is read from the
manager's own ``decode_kv_args_table`` after a marker registration sent behind the message under test was processed
(one listener thread, in order: no sleeps), and is printed as one JSON line.

Cases: a signed registration; an unsigned one; a captured signed registration replayed after the victim registered
again; a malformed message and a handler that raises, then a good registration; a message signed by sglang-harden's
plugin code (right and wrong secret; patched only); the manager's and the receiver's signed frames as the plugin
verifies them (patched only); the manager's sockets to 8 peers with a cap of 3.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

from sglang_harden.compat.internals import SIDE_CHANNELS_BACKPORT
from sglang_harden.testbed.patched_bootstrap import PatchedFiles

HOST = "127.0.0.1"
WAIT_S = 10.0
SIDE = SIDE_CHANNELS_BACKPORT


def registration(session: str, ptr: int, state_frame: bool = True) -> list[bytes]:
    """A minimal Mooncake decode registration (frames 10+ take their defaults; 0.4.x has no state frame)."""
    state = [b""] if state_frame else []
    return [b"None", HOST.encode(), b"40001", session.encode(), struct.pack("Q", ptr), struct.pack("Q", 0x1000),
            *state, b"0", b"1", b"4096"]


class _Table(dict):
    """``decode_kv_args_table``, where storing the registration of a session in ``raise_for`` raises once (a
    handler that fails on a well-formed message)."""

    raise_for: set[str] = set()

    def __setitem__(self, key: str, value: Any) -> None:
        if key in self.raise_for:
            self.raise_for.discard(key)
            raise RuntimeError("a handler raised on a well-formed message")
        super().__setitem__(key, value)


class Prefill:
    """A Mooncake prefill manager without its ``__init__``: the attributes its listener reads, a real rank port."""

    def __init__(self, conn: Any, mooncake: Any, patched: bool, role_switch: bool) -> None:
        import zmq
        from sglang.srt.disaggregation.utils import DisaggregationMode

        m = mooncake.MooncakeKVManager.__new__(mooncake.MooncakeKVManager)
        m._zmq_ctx = zmq.Context()
        m.local_ip = HOST
        m.disaggregation_mode = DisaggregationMode.PREFILL
        self.binds_itself = hasattr(mooncake.MooncakeKVManager, "_bind_server_socket")  # 0.4.x
        self.early = not hasattr(mooncake.MooncakeKVManager, "_send_multipart_locked")
        if self.binds_itself:
            m.server_socket = zmq.Context().socket(zmq.PULL)
        else:
            m.rank_port, m.server_socket = conn.get_zmq_socket_on_host(m._zmq_ctx, zmq.PULL, host=HOST)
            if patched:  # what the series does right after this bind
                sys.modules[SIDE].guard_rank_port(m, wire_rules=not self.early)
        m._stopped = False
        m.deferred_bootstrap = None
        m.server_args = types.SimpleNamespace(enable_pd_role_switch=role_switch)
        m._staging_ctx = None
        m.transfer_infos, m.request_status, m.decode_kv_args_table = {}, {}, _Table()
        m.enable_deferred_decode_kv_release = False
        m._deferred_ack_targets, m._deferred_ack_poisoned_rooms, m._staging_outstanding = {}, set(), {}
        m.req_to_decode_prefix_len, m._worker_threads = {}, []
        m.is_mla_backend, m._kv_replica_factor, m.defer_decode_allocation = False, 1, False
        m.session_lock, m.failed_sessions, m.session_failures = threading.Lock(), set(), {}
        m.state_layout_rejections, m.state_strides_validated = {}, set()
        m._validate_peer_state_layout = lambda info: (True, None)
        m._unblacklist_session = lambda session: None
        m.check_peer_aux_buffer_count = lambda *args: None
        m._socket_cache, m._monitor_cache, m._socket_send_locks = {}, {}, {}
        m._socket_lock = threading.Lock()
        m.requires_dcp_relayout = lambda *args: False
        m.kv_args = types.SimpleNamespace(engine_rank=0)
        self.manager = m

    def start(self) -> None:
        self.manager.start_prefill_thread()  # 0.4.x: binds the rank port first

    @property
    def endpoint(self) -> str:
        return f"tcp://{HOST}:{self.manager.rank_port}"

    def ptr(self, session: str) -> int | None:
        info = self.manager.decode_kv_args_table.get(session)
        return None if info is None else info.dst_kv_ptrs[0]


class Run:
    def __init__(self, tree: str, role_switch: bool) -> None:
        if tree != "-":
            sys.meta_path.insert(0, PatchedFiles(Path(tree).resolve()))
        import zmq
        from sglang.srt.disaggregation.common import conn
        from sglang.srt.disaggregation.mooncake import conn as mooncake

        self.zmq, self.conn, self.mooncake = zmq, conn, mooncake
        self.side = sys.modules.get(SIDE)
        self.patched = self.side is not None
        self.deaths: list[str] = []
        threading.excepthook = lambda args: self.deaths.append(type(args.exc_value).__name__)
        self.prefill = Prefill(conn, mooncake, self.patched, role_switch)
        self.early = self.prefill.early
        self.prefill.start()
        self.raw_ctx = zmq.Context()
        self.raw = self.raw_ctx.socket(zmq.PUSH)  # an outsider's socket: sends what it is given, unsigned
        self.raw.connect(self.prefill.endpoint)
        self.markers, self.alive, self.last_raw = 0, True, False
        self.secret = Path(os.environ["SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"]).read_text().splitlines()[0]

    def registration(self, session: str, ptr: int) -> list[bytes]:
        return registration(session, ptr, state_frame=not self.prefill.binds_itself)

    def signed(self, frames: list[bytes]) -> None:
        """Decode's socket to this prefill rank (the receiver's ``_connect``: signing, patched)."""
        sock, lock = self.mooncake.MooncakeKVReceiver._connect(self.prefill.endpoint)
        with lock:
            sock.send_multipart(frames)

    def sent(self, frames: list[bytes], signed: bool) -> None:
        self.signed(frames) if signed else self.raw_sent(frames)

    def raw_sent(self, frames: list[bytes]) -> None:
        self.raw.send_multipart(frames)
        self.last_raw = True

    def processed(self) -> bool:
        """Send a signed marker registration behind what was sent; True once the listener processed it."""
        self.markers += 1
        session = f"{HOST}:{19000 + self.markers}"
        marker = self.registration(session, 0x5000 + self.markers)
        # on the connection the message under test took: a PULL socket orders messages per connection only
        if self.last_raw:
            self.raw.send_multipart(plugin_signed(marker, self.prefill.endpoint, self.secret) if self.patched
                                    else marker)
        else:
            self.signed(marker)
        self.last_raw = False
        deadline = time.monotonic() + (WAIT_S if self.alive else 1.0)  # a dead listener stays dead
        while time.monotonic() < deadline:
            if self.prefill.ptr(session) is not None:
                return True
            time.sleep(0.02)
        self.alive = False
        return False

    def captured(self, frames: list[bytes]) -> list[bytes]:
        """``frames`` as decode's socket puts them on the wire to this rank port (what an observer records)."""
        tap = self.raw_ctx.socket(self.zmq.PULL)
        port = tap.bind_to_random_port(f"tcp://{HOST}")
        push = self.raw_ctx.socket(self.zmq.PUSH)
        push.connect(f"tcp://{HOST}:{port}")
        if self.patched:
            self.side.sign_socket(push, self.prefill.endpoint)
        push.send_multipart(frames)
        wire = tap.recv_multipart()
        push.close(linger=0)
        tap.close(linger=0)
        return wire

    def case(self, name: str, frames: list[bytes], signed: bool) -> dict[str, Any]:
        self.sent(frames, signed)
        session = frames[3].decode() if len(frames) > 3 else ""
        return {"case": name, "listener_alive": self.processed(), "ptr": self.prefill.ptr(session) if session else None}


def plugin_signed(frames: list[bytes], destination: str, secret: str) -> list[bytes]:
    from sglang_harden.guards.bootstrap_auth import parse_secrets
    from sglang_harden.guards.zmq_auth import Signer

    return [*frames, Signer().sign(parse_secrets(secret), frames, destination)]


def plugin_verdicts(run: Run, secret: str) -> dict[str, Any]:
    """What the plugin's verifier says of the frames the patched manager's and receiver's sockets send (early
    releases: and of the page-lifecycle patch's drain acknowledgement)."""
    from sglang_harden.guards.bootstrap_auth import parse_secrets
    from sglang_harden.guards.zmq_auth import ReplayWindow, split, verify

    zmq, out = run.zmq, {}
    tap = run.raw_ctx.socket(zmq.PULL)
    tap_endpoint = f"tcp://{HOST}:{tap.bind_to_random_port(f'tcp://{HOST}')}"
    manager = run.prefill.manager
    if run.early:
        manager._connect(tap_endpoint).send_multipart([b"ABORT_ACK", b"7"])
        from sglang.srt.mem_cache import pd_lifecycle

        pd_lifecycle._send_ack_frames(manager, 7, HOST, int(tap_endpoint.rsplit(":", 1)[1]))
    else:
        manager._send_multipart_locked(tap_endpoint, [b"ABORT_ACK", b"7"])
    sock, lock = run.mooncake.MooncakeKVReceiver._connect(tap_endpoint)
    with lock:
        sock.send_multipart([b"ABORT", b"7"])
    window = ReplayWindow(125.0)
    names = {b"ABORT_ACK": "manager", b"ABORT": "receiver", b"SGH_ABORT_ACK": "lifecycle ack"}
    for _ in range(3 if run.early else 2):  # one socket each: any may arrive first
        own, auth = split(tap.recv_multipart())
        decision, _ = verify(parse_secrets(secret), own, auth, tap_endpoint, window)
        tampered, _ = verify(parse_secrets(secret), [*own[:-1], b"8"], auth, tap_endpoint, ReplayWindow(125.0))
        who = names[own[0]]
        out[who] = {"frames": [f.decode() for f in own], "signed": auth is not None,
                    "verdict": decision.verdict.value, "tampered": tampered.verdict.value}
    tap.close(linger=0)
    return out


def main(tree: str, role_switch: bool) -> dict[str, Any]:
    secret = Path(os.environ["SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"]).read_text().splitlines()[0]
    run = Run(tree, role_switch)
    p = run.prefill
    registration = run.registration
    cases = [run.case("signed registration", registration(f"{HOST}:15001", 0xA000), signed=True),
             run.case("unsigned registration", registration(f"{HOST}:15002", 0xB000), signed=False)]
    victim = f"{HOST}:15003"
    old = run.captured(registration(victim, 0xC000))
    run.raw_sent(old)  # the victim's first registration, as it crossed the wire
    first = run.processed() and p.ptr(victim)
    run.sent(registration(victim, 0xC100), signed=True)  # the victim registers again (new buffers)
    again = run.processed() and p.ptr(victim)
    run.raw_sent(old)  # an observer replays the first one
    cases.append({"case": "replayed registration", "first": first, "again": again, "listener_alive": run.processed(),
                  "ptr": p.ptr(victim)})
    cases.append(run.case("unsigned malformed", [b"x"], signed=False))
    cases.append(run.case("signed malformed", [b"x"], signed=True))
    _Table.raise_for.add(f"{HOST}:15004")
    cases.append(run.case("handler raises", registration(f"{HOST}:15004", 0xD000), signed=True))
    cases.append(run.case("after the failures", registration(f"{HOST}:15005", 0xE000), signed=True))
    interop: dict[str, Any] = {}
    if run.patched:
        for name, key, session in (("plugin signed", secret, 15006), ("plugin signed, other secret", "o" * 64, 15007)):
            frames = plugin_signed(registration(f"{HOST}:{session}", 0xF000), p.endpoint, key)
            run.raw_sent(frames)
            cases.append({"case": name, "listener_alive": run.processed(), "ptr": p.ptr(f"{HOST}:{session}")})
        interop = plugin_verdicts(run, secret)
        run.side.MAX_PEER_SOCKETS = 3
    peer_sockets = None  # early releases keep no socket cache to cap (0.4.x: a socket per send)
    if not run.early:
        for port in range(8):
            p.manager._send_multipart_locked(f"tcp://{HOST}:{1 + port}", [b"x"])
        peer_sockets = len(p.manager._socket_cache)
    counts = ({f"{g}/{v}": n for (g, v), n in run.side.COUNTS.items()} if run.patched else {})
    return {"patched": run.patched, "early": run.early, "cases": cases, "deaths": run.deaths, "interop": interop,
            "peer_sockets": peer_sockets, "counts": counts,
            "status": run.side.status() if run.patched else "vanilla"}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], "--role-switch" in sys.argv[2:])), flush=True)
    os._exit(0)  # the listener thread and the sockets' contexts need no orderly shutdown
