"""SGLang's real ZMQ listener closures, driven one message at a time (run under a pin venv).

One KV manager per backend and role is built without ``__init__`` (which would open a transfer engine and bind a
socket) and given what its listener reads. Its rank port is either a plain queue (vanilla) or, hardened, a real
pyzmq PULL socket of the verifying class on an ``inproc://`` address, fed by a PUSH socket (``compat/zmq_sockets``:
the ``Inbox`` verifies and strips the auth frame, then asks the wire rules): the listener reads what the hardened
receive admitted. Its real ``start_prefill_thread`` / ``start_decode_thread`` (Mooncake),
``_start_bootstrap_thread`` / ``_start_decode_listener_thread`` (NIXL), ``_start_bootstrap_thread`` /
``_start_decode_thread`` (MORI) builds SGLang's own listener closure and hands it to ``threading.Thread``; the
harness keeps that target instead of starting it and runs it on the caller's thread, one message at a time: the
socket hands out the message, and the closure's next ``recv_multipart`` (nothing more queued) ends the run. The
closures keep nothing across iterations but the ``recv`` they bound at start, so this is the thread's loop,
iteration by iteration, without a thread switch per message (which costs milliseconds on a busy two-core machine).
An exception that leaves the closure is what would have ended the thread; MORI's loops catch every exception and log
it with ``logger.exception``, which the harness counts as raising too.

What stands in: the sends (recorded, never sent), NIXL's agent and payload preparation, MORI's engine (a stand-in
``mori`` package), Mooncake's state-layout check (it reads the scheduler's global config), the heartbeat thread.
What is real: the listener loops, every parser and handler they call, ``update_status``, the abort/ack
bookkeeping, and the ctypes AUX_DATA write (into a buffer with guard bytes around each aux buffer, checked after
every message).
"""

from __future__ import annotations

import copy
import ctypes
import importlib.util
import logging
import sys
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import msgspec
import zmq

from sglang_harden.compat.zmq_sockets import Inbox, VerifyingSocket, make_verifying

ROOMS = (1, 2, 3, 7)  # rooms the managers know (prefill: Bootstrapping; decode: waiting for the transfer)
AUX_BUFFERS = ((64, 8), (32, 4))  # (items, item_len) of each aux buffer
GUARD = 64
GUARD_BYTE = 0xA5
POOL_PAGES, PAGE_SIZE, KV_ITEM_LEN = 64, 1, 256
LOCAL_IP, RANK_PORT = "127.0.0.1", 40000
ENDPOINT = f"{LOCAL_IP}:{RANK_PORT}"  # the rank port as its peers address it (what they sign for)


class _Pause(BaseException):
    """Raised by the socket when the listener asks for the next message: the closure has finished this one.
    A BaseException, so that no listener loop (MORI's catch ``Exception``) swallows it."""


class QueueSocket:
    """The listener's PULL socket: hands out the queued message, then ends the run."""

    def __init__(self) -> None:
        self.items: deque[list[bytes]] = deque()

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> list[bytes]:
        if not self.items:
            raise _Pause
        return self.items.popleft()

    def close(self, linger: int = 0) -> None:
        pass


class PausingSocket(VerifyingSocket):
    """The hardened rank port: the verifying receive (a refused message never comes out); when nothing more is
    queued the run pauses instead of blocking."""

    _sgh_admitted: int = 0  # messages the listener got (declared: pyzmq takes unknown attributes as options)

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        try:
            frames = super().recv_multipart(flags | zmq.NOBLOCK, copy=copy, track=track)
        except zmq.Again:
            raise _Pause from None
        self._sgh_admitted += 1
        return frames


def _verifying_pair(name: str) -> tuple[PausingSocket, Any]:
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL, socket_class=PausingSocket)
    pull.bind(f"inproc://{name}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"inproc://{name}")
    return pull, push


class ListenerDied(AssertionError):
    pass


class Listener:
    """One manager and its listener closure."""

    caught: list[str] = []  # what MORI's loops caught while a listener ran (see _CaughtLogger)

    def __init__(self, backend: str, role: str, conn: ModuleType, pin: tuple[int, ...], *,
                 verifying: bool = False) -> None:
        self.backend, self.role, self.conn, self.pin = backend, role, conn, pin
        self.push: Any = None
        self.socket: Any = QueueSocket()
        if verifying:
            self.socket, self.push = _verifying_pair(f"wire-{backend}-{role}-{id(self)}")
        self.sent: list[tuple[str, list[bytes]]] = []
        self.aux_memory, self.aux_ptrs = _aux_buffers()
        self.died: str | None = None
        self.victim: Any = None
        self.manager = _build(self)
        reset(self)
        self.loop = _capture_listener(self)

    def feed(self, frames: list[bytes]) -> None:
        """Run the listener on ``frames``; raises :class:`ListenerDied` if it raised (and stays dead)."""
        if self.died:
            raise ListenerDied(f"{self.backend} {self.role} listener is dead: {self.died}")
        if not frames:
            return  # a message of no frames does not exist on the wire (ZeroMQ cannot send one)
        if self.push is not None:
            self.push.send_multipart(frames)
        else:
            self.socket.items.append(frames)
        Listener.caught.clear()
        try:
            self.loop()
        except _Pause:
            pass
        except Exception as exc:  # noqa: BLE001 - the thread would have ended here
            self.died = f"{type(exc).__name__}: {str(exc)[:120]}"
        else:
            self.died = "the listener loop returned"
        if Listener.caught and not self.died:
            self.died = Listener.caught[0]
        if self.push is None:
            self.socket.items.clear()
        if self.died:
            raise ListenerDied(f"{self.backend} {self.role} listener raised: {self.died}")
        self.check_aux_guards()

    def guard(self, rules: Any) -> Inbox:
        """The hardened rank port admits through a new :class:`Inbox` asking ``rules``."""
        inbox = Inbox(ENDPOINT, f"{self.role} {self.backend}", rules)
        make_verifying(self.socket, inbox)
        return inbox

    def close(self) -> None:
        if self.push is not None:
            self.push.close(linger=0)
            self.socket.close(linger=0)

    def snapshot(self) -> dict[str, Any]:
        """The manager's listener state now (dicts of dicts and sets copied two levels deep)."""
        return {name: _copy(value) for name, value in self.manager.__dict__.items() if name in _STATE}

    def restore(self, state: dict[str, Any]) -> None:
        """Back to ``state``, listener restarted (the closure keeps nothing across messages)."""
        self.sent.clear()
        self.died = None
        self.manager.__dict__.update({name: _copy(value) for name, value in state.items()})

    def alive(self) -> bool:
        return self.died is None

    def check_aux_guards(self) -> None:
        raw = (ctypes.c_ubyte * len(self.aux_memory)).from_buffer(self.aux_memory)
        for start, end in _guard_ranges():
            if any(b != GUARD_BYTE for b in raw[start:end]):
                raise AssertionError(f"an AUX_DATA write landed outside its buffer (bytes {start}..{end})")


class _CaughtLogger(logging.LoggerAdapter):
    """MORI's loops catch every Exception and log it with ``logger.exception``: that is a listener raising."""

    def exception(self, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = sys.exc_info()[1]
        Listener.caught.append(f"{type(exc).__name__}: {str(exc)[:120]} (caught: {msg})")


class _ThreadCapture:
    """Stands in for the backend module's ``threading`` while the start method runs: keeps the targets."""

    def __init__(self) -> None:
        self.targets: list[Callable[[], None]] = []

    def Thread(self, target: Callable[[], None], *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        self.targets.append(target)
        return SimpleNamespace(start=lambda: None, join=lambda timeout=None: None, is_alive=lambda: False,
                               daemon=kwargs.get("daemon", False), name=getattr(target, "__name__", "listener"))

    def __getattr__(self, name: str) -> Any:
        return getattr(threading, name)


START = {("mooncake", "prefill"): "start_prefill_thread", ("mooncake", "decode"): "start_decode_thread",
         ("nixl", "prefill"): "_start_bootstrap_thread", ("nixl", "decode"): "_start_decode_listener_thread",
         ("mori", "prefill"): "_start_bootstrap_thread", ("mori", "decode"): "_start_decode_thread"}


def _capture_listener(listener: Listener) -> Callable[[], None]:
    capture, conn = _ThreadCapture(), listener.conn
    real = conn.threading
    conn.threading = capture
    try:
        getattr(listener.manager, START[(listener.backend, listener.role)])()
    finally:
        conn.threading = real
    assert len(capture.targets) == 1, f"expected one listener thread, got {capture.targets}"
    return capture.targets[0]


# ---------------------------------------------------------------------------------------------- managers


def _aux_buffers() -> tuple[bytearray, list[int]]:
    size = sum(GUARD + items * item_len for items, item_len in AUX_BUFFERS) + GUARD
    memory = bytearray([GUARD_BYTE]) * size
    base = ctypes.addressof((ctypes.c_char * size).from_buffer(memory))
    ptrs, offset = [], GUARD
    for items, item_len in AUX_BUFFERS:
        ptrs.append(base + offset)
        offset += items * item_len + GUARD
    return memory, ptrs


def _guard_ranges() -> list[tuple[int, int]]:
    ranges, offset = [(0, GUARD)], GUARD
    for items, item_len in AUX_BUFFERS:
        offset += items * item_len
        ranges.append((offset, offset + GUARD))
        offset += GUARD
    return ranges


def kv_args(listener: Listener) -> SimpleNamespace:
    return SimpleNamespace(
        kv_data_ptrs=[0x10000, 0x20000], kv_data_lens=[POOL_PAGES * KV_ITEM_LEN] * 2,
        kv_item_lens=[KV_ITEM_LEN] * 2, kv_layer_ids=[0, 1], kv_data_mem_kinds=["VRAM", "VRAM"],
        aux_data_ptrs=list(listener.aux_ptrs), aux_data_lens=[n * m for n, m in AUX_BUFFERS],
        aux_item_lens=[m for _, m in AUX_BUFFERS], state_data_ptrs=[], state_data_lens=[], state_item_lens=[],
        state_dim_per_tensor=[], state_layer_ids=[], state_types=[], page_size=PAGE_SIZE, engine_rank=0, gpu_id=0,
        num_draft_entries=0, ib_device=None)


def _build(listener: Listener) -> Any:
    conn, role = listener.conn, listener.role
    cls = {"mooncake": "MooncakeKVManager", "nixl": "NixlKVManager", "mori": "MoriKVManager"}[listener.backend]
    mgr = object.__new__(getattr(conn, cls))
    mode = conn.DisaggregationMode.PREFILL if role == "prefill" else conn.DisaggregationMode.DECODE
    mgr.__dict__.update(
        server_socket=listener.socket, disaggregation_mode=mode, kv_args=kv_args(listener), _stopped=False,
        server_args=SimpleNamespace(enable_pd_role_switch=False), deferred_bootstrap=None, _staging_ctx=None,
        _staging_handler=None, enable_staging=False, _worker_threads=[], is_mla_backend=False,
        is_hybrid_mla_backend=False, _kv_replica_factor=1, dcp_size=1, dcp_rank=0, attn_tp_size=1, attn_tp_rank=0,
        attn_cp_size=1, attn_cp_rank=0, pp_size=1, pp_rank=0, state_tp_size=1, _dcp_pack_buffers=None,
        session_lock=threading.Lock(), transfer_lock=threading.Lock(), failure_lock=threading.Lock(),
        _abort_ack_lock=threading.Lock(), local_ip=LOCAL_IP, rank_port=RANK_PORT, bootstrap_port=8998,
        transfer_queues=[SimpleNamespace(put=lambda item: None)], src_mem_kind="VRAM", prep_handles={},
        _deferred_abort_generation=0, _heartbeat_shutdown=threading.Event())
    mgr._send_multipart_locked = lambda endpoint, parts, is_ipv6=False: listener.sent.append((endpoint, parts))
    mgr._start_heartbeat_checker_thread = lambda: threading.Thread(target=lambda: None)
    if listener.backend == "nixl":
        mgr.agent = SimpleNamespace(add_remote_agent=lambda metadata: None, name="prefill-agent")
        mgr._prepare_payload_xfer = lambda info: None
        mgr._prepare_state_xfer = lambda info: None
    if listener.backend == "mori":
        mgr.engine = SimpleNamespace(register_remote_engine=lambda desc: None)
        mgr._zmq_ctx = None
        if not isinstance(conn.logger, _CaughtLogger):
            conn.logger = _CaughtLogger(conn.logger, {})
    return mgr


_STATE = ("transfer_infos", "decode_kv_args_table", "req_to_decode_prefix_len", "failure_records", "failed_sessions",
          "session_failures", "failed_session_probes", "state_layout_rejections", "state_strides_validated",
          "_deferred_ack_targets", "_deferred_ack_poisoned_rooms", "_deferred_ack_fanout_snapshots",
          "_staging_outstanding", "prefill_response_tracker", "required_prefill_response_num_table", "request_status",
          "room_to_bootstrap_addr", "addr_to_rooms_tracker", "_deferred_abort_ack_tracker")


def same_state(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Two snapshots hold the same tables, down to the very objects SGLang stored (no re-parse, no replacement)."""
    return before.keys() == after.keys() and all(_same(before[k], after[k]) for k in before)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, set | frozenset) and isinstance(b, set | frozenset):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - arrays and the like: only the same object counts
        return False


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        outer = copy.copy(value)  # keeps a defaultdict's factory
        for key, inner in outer.items():
            if isinstance(inner, dict | set | list):
                outer[key] = copy.copy(inner)
            elif isinstance(inner, msgspec.Struct):  # DeferredAbortAckState: its set of acked ranks
                outer[key] = msgspec.structs.replace(inner, **{
                    name: copy.copy(getattr(inner, name)) for name in inner.__struct_fields__
                    if isinstance(getattr(inner, name), dict | set | list)})
        return outer
    return copy.copy(value) if isinstance(value, set | list) else value


def reset(listener: Listener) -> None:
    """Fresh per-example state: the known rooms, nothing registered, nothing sent."""
    mgr, conn = listener.manager, listener.conn
    poll = conn.KVPoll
    listener.sent.clear()
    listener.died = None
    deferred = listener.pin >= (0, 5, 21)
    mgr.__dict__.update(
        transfer_infos={}, decode_kv_args_table={}, req_to_decode_prefix_len={}, failure_records={},
        failed_sessions=set(), session_failures=defaultdict(int), failed_session_probes={}, state_layout_rejections={},
        state_strides_validated=set(), _deferred_ack_targets={}, _deferred_ack_poisoned_rooms=set(),
        _deferred_ack_fanout_snapshots={}, _staging_outstanding=defaultdict(int),
        enable_deferred_decode_kv_release=deferred, prefill_response_tracker=defaultdict(set),
        required_prefill_response_num_table={room: 1 for room in ROOMS}, room_to_bootstrap_addr={},
        addr_to_rooms_tracker={})
    if listener.role == "prefill":
        mgr.request_status = {room: poll.Bootstrapping for room in ROOMS}
    else:
        mgr.request_status = {room: poll.WaitingForInput for room in ROOMS}
        from sglang.srt.disaggregation.common import conn as common

        state = getattr(common, "DeferredAbortAckState", None)
        mgr._deferred_abort_ack_tracker = {
            room: (state(generation=1, prefill_ranks=set()) if state is not None else set()) for room in ROOMS}


# -------------------------------------------------------------------------------------------------- MORI


class _EngineDesc:
    """Stands in for ``mori.io.EngineDesc``: the key travels as ``b"engine:" + key``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def pack(self) -> bytes:
        return b"engine:" + self.key.encode("ascii")

    @classmethod
    def unpack(cls, blob: bytes) -> _EngineDesc:
        if not blob.startswith(b"engine:") or len(blob) == 7:
            raise ValueError("not an engine descriptor")
        return cls(blob[7:].decode("ascii"))


class _MemoryDesc:
    @classmethod
    def unpack(cls, blob: Any) -> _MemoryDesc:
        if not isinstance(blob, bytes) or not blob.startswith(b"mem:"):
            raise ValueError("not a memory descriptor")
        return cls()


def pack_mem_descs(count: int) -> bytes:
    return msgspec.msgpack.encode([b"mem:%d" % i for i in range(count)]) if count else b""


def mori_conn() -> ModuleType:
    """The pin's ``mori/conn.py`` over a stand-in ``mori`` package (shared with test_mori_inprocess.py's)."""
    package = sys.modules.get("mori") or ModuleType("mori")
    cpp = sys.modules.get("mori.cpp") or ModuleType("mori.cpp")
    io = sys.modules.get("mori.io") or ModuleType("mori.io")
    if not hasattr(cpp, "TransferStatus"):
        cpp.TransferStatus = type("TransferStatus", (), {})  # type: ignore[attr-defined]
    for name in ("BackendType", "IOEngine", "IOEngineConfig", "MemoryLocationType", "PollCqMode",
                 "RdmaBackendConfig", "StatusCode", "EngineDesc", "MemoryDesc"):
        if not hasattr(io, name):
            setattr(io, name, type(name, (), {}))
    io.EngineDesc.unpack = _EngineDesc.unpack  # type: ignore[attr-defined]
    io.MemoryDesc.unpack = _MemoryDesc.unpack  # type: ignore[attr-defined]
    package.cpp, package.io = cpp, io  # type: ignore[attr-defined]
    sys.modules.update({"mori": package, "mori.cpp": cpp, "mori.io": io})
    from sglang_harden.compat.hooks import HookInstallError

    try:
        from sglang.srt.disaggregation.mori import conn
    except HookInstallError:
        # An earlier test of this process armed the lifecycle guard, which refuses this release's MORI: load the
        # same file under a private name, unhooked (this module is about the listener, not the guard).
        import sglang

        path = Path(sglang.__file__).parent / "srt" / "disaggregation" / "mori" / "conn.py"
        spec = importlib.util.spec_from_file_location("sglang_harden_wire_mori_conn", path)
        assert spec is not None and spec.loader is not None
        conn = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = conn
        spec.loader.exec_module(conn)
    # the stand-in types the parsers use are the module's own globals
    conn.EngineDesc.unpack = _EngineDesc.unpack
    conn.MemoryDesc.unpack = _MemoryDesc.unpack
    return conn
