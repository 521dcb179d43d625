"""Fault injection (test-only): a KV write that lands late, Mooncake or NIXL. Env: SGLANG_HARDEN_TESTBED_LATE_WRITE.

``SGLANG_HARDEN_TESTBED_LATE_WRITE="<delay_s>:<room>[,<room>…][:timeout=<s>][:trigger=<path>][:rid_prefix=<p>]"``
acts on prefill's KV writes of the listed bootstrap rooms, and with ``rid_prefix`` also of the room of every
request whose rid starts with ``p`` (learnt when prefill's scheduler takes the request in: behind sglang-router the
room is chosen by the router, so the test can only name the request):

- Mooncake: ``MooncakeKVManager._transfer_data``, the call into the transfer engine (0.4.x: ``send_kvcache``, whose
  executor threads make the engine calls);
- NIXL: the post of the KV transfer handle (``nixl_agent.transfer`` called from inside
  ``NixlKVManager.send_kvcache`` / ``send_kvcache_mixed`` / ``send_kvcache_slice``; the aux and state posts of the
  same room are left alone).

The two backends get the same three behaviours:

- without ``timeout``: the transfer worker sleeps ``delay_s``, then writes (a slow write that blocks the worker;
  Mooncake serialises all rooms of one decode session on one queue, so later transfers wait behind it; a NIXL
  worker is blocked the same way and its room stays counted as in flight, so no drain ack goes out meanwhile);
- with ``trigger=<path>``: the write lands as soon as ``path`` exists (the test creates it when a victim is
  decoding), at the latest after ``delay_s``;
- with ``timeout=<s>``: the engine call gives up after ``s`` seconds and reports failure, while the write
  itself still lands ``delay_s`` after it started, from another thread: a timed-out batch whose bytes are
  still on the wire. Mooncake: the call returns -1; this is the path upstream's drain ack cannot see (the worker
  has moved on). A failed engine call makes prefill blacklist the decode session; 0.5s later the shim
  un-blacklists it the way upstream's failed-session probe does on recovery (``_run_one_probe_pass``), so later
  requests flow again. NIXL: the post returns ``"ERR"`` (0.5.23 raises its post error, fails the room, tells
  decode, and "poisons" the room's drain ack: decode's only exit is then its release timeout), while the same
  handle is posted for real later and its bytes land in decode's pages.

Each late write is logged as one JSON line (room, when it started and landed) to
``$SGLANG_HARDEN_TESTBED_KVTRACE_DIR/latewrite-<pid>.jsonl``; a timed-out call adds an ``engine_timeout`` line,
and every KV send of a listed room adds a ``kv_send`` line first, with the decode pages it targets
(``dst_pages``: the test lands the write when a victim decodes over one of them).
The room of the chunk being written is taken from the transfer worker's ``FastQueue.get`` on the same thread.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import append_trace_line

from sglang_harden._importhook import when_imported

ENV = "SGLANG_HARDEN_TESTBED_LATE_WRITE"
_tls = threading.local()


_trigger: Path | None = None
_rid_prefix = ""
# the listed rooms; one set shared by every patch in this process, so rooms learnt by rid reach the KV senders
_rooms: set[int] = set()


def parse(raw: str) -> tuple[float, set[int], float | None]:
    global _trigger, _rid_prefix
    parts = raw.split(":")
    delay = float(parts[0])
    _rooms.update(int(r) for r in parts[1].split(",") if r.strip())
    timeout = None
    for extra in parts[2:]:
        key, _, value = extra.partition("=")
        if key == "timeout":
            timeout = float(value)
        elif key == "trigger":
            _trigger = Path(value)
        elif key == "rid_prefix":
            _rid_prefix = value
    return delay, _rooms, timeout


def _wait(delay: float) -> None:
    """Sleep ``delay``, or less when the trigger file appears first."""
    deadline = time.time() + delay
    while time.time() < deadline:
        if _trigger is not None and _trigger.exists():
            return
        time.sleep(0.02)


def _emit(record: dict[str, Any]) -> None:
    append_trace_line("latewrite", record)


def _patch_queue(module: ModuleType) -> None:
    cls = module.FastQueue
    if getattr(cls, "_sglang_harden_latewrite", False):
        return
    original = cls.get

    def get(self: Any, *args: Any, **kwargs: Any) -> Any:
        item = original(self, *args, **kwargs)
        _tls.room = getattr(item, "room", None)
        return item

    cls.get = get
    cls._sglang_harden_latewrite = True


def _late(original: Any, delay: float, room: int, args: tuple[Any, ...], mode: str) -> int:
    started = time.time()
    _wait(delay)
    status = original(*args)
    _emit(
        {
            "event": "late_write",
            "mode": mode,
            "room": room,
            "delayed_s": round(time.time() - started, 3),
            "triggered": _trigger is not None and _trigger.exists(),
            "started": started,
            "t": time.time(),
            "status": int(status),
            "blocks": len(args[2]),
        }
    )
    return int(status)


# SGLang's methods that post the KV write of a chunk (any pin and backend that has them); aux/state posts are
# not delayed.
KV_SENDS = ("send_kvcache", "send_kvcache_mixed", "send_kvcache_slice")


def _marks_kv_send(original: Any, rooms: set[int]) -> Any:
    """Marks the thread while SGLang posts a KV write and logs the decode pages a listed room's send targets;
    keeps ``original``'s attributes (an sglang-harden hook's mark among them, so the guard's start-up check still
    finds its hook under this wrapper)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def send(self: Any, peer_name: Any, prefill_kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        room = getattr(_tls, "room", None)
        if room in rooms:
            bound = signature.bind_partial(self, peer_name, prefill_kv_indices, *args, **kwargs).arguments
            dst = bound.get("dst_kv_indices")  # a numpy array on SGLang's side
            _emit({"event": "kv_send", "room": room, "t": time.time(),
                   "dst_pages": [] if dst is None else [int(p) for p in dst]})
        _tls.kv_pages = len(prefill_kv_indices)
        try:
            return original(self, peer_name, prefill_kv_indices, *args, **kwargs)
        finally:
            _tls.kv_pages = None

    return send


def _mark_kv_sends(cls: Any, rooms: set[int]) -> list[str]:
    sends = [name for name in KV_SENDS if hasattr(cls, name)]
    if "send_kvcache" not in sends:
        raise RuntimeError(f"latewrite shim: {cls.__name__}.send_kvcache not found on this SGLang pin")
    for name in sends:
        setattr(cls, name, _marks_kv_send(getattr(cls, name), rooms))
    return sends


def _probe_recovers(mgr: Any, session_id: str) -> None:
    with mgr.session_lock:
        mgr.failed_sessions.discard(session_id)
        mgr.session_failures.pop(session_id, None)


def _delays(original: Any, delay: float, rooms: set[int], timeout: float | None) -> Any:
    """``original(self, session_id, blocks, *rest)`` (a call that writes KV) made late for the listed rooms."""

    def write(self: Any, session_id: str, blocks: Any, *rest: Any) -> Any:
        room = getattr(_tls, "room", None)
        if room not in rooms or blocks is None or not len(blocks):
            return original(self, session_id, blocks, *rest)
        args = (self, session_id, blocks if hasattr(blocks, "__len__") else list(blocks), *rest)
        if timeout is None:
            return _late(original, delay, room, args, "blocking")
        threading.Thread(target=_late, args=(original, delay, room, args, "timed_out"), daemon=True).start()
        time.sleep(timeout)
        _emit({"event": "engine_timeout", "room": room, "t": time.time(), "timeout_s": timeout})
        threading.Timer(0.5, _probe_recovers, (self, session_id)).start()
        return -1

    return write


def _engine_called_off_the_worker_thread(cls: Any) -> bool:
    """0.4.x's ``send_kvcache`` calls the engine only from its executor's threads, which do not know the room (0.4.10
    through ``_transfer_data``, which the worker thread also calls for the aux data): the whole send is made late."""
    if not hasattr(cls, "_transfer_data"):
        return True
    try:
        from sglang.version import __version__
    except ImportError:  # a stand-in manager, no SGLang here (unit tests)
        return False
    return str(__version__).startswith("0.4.")


def _patch_manager(module: ModuleType) -> None:
    cls = module.MooncakeKVManager
    if getattr(cls, "_sglang_harden_latewrite", False):
        return
    delay, rooms, timeout = parse(os.environ[ENV])
    if _engine_called_off_the_worker_thread(cls):
        cls.send_kvcache = functools.wraps(cls.send_kvcache)(_delays(cls.send_kvcache, delay, rooms, timeout))
    else:
        cls._transfer_data = _delays(cls._transfer_data, delay, rooms, timeout)
    _mark_kv_sends(cls, rooms)
    cls._sglang_harden_latewrite = True


# ------------------------------------------------------------------------------------------------ nixl

NIXL_SETTLE_LIMIT_S = 60.0


def _settle(agent: Any, original: Any, handle: Any) -> str:
    """Post ``handle`` through the agent's own ``transfer`` and wait until it is DONE or ERR."""
    state = original(handle)
    deadline = time.monotonic() + NIXL_SETTLE_LIMIT_S
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.005)
        state = agent.check_xfer_state(handle)
    return str(state)


def _late_nixl(agent: Any, original: Any, handle: Any, room: int, pages: int, mode: str) -> str:
    started = time.time()
    _wait(_nixl_delay)
    state = _settle(agent, original, handle)
    _emit(
        {
            "event": "late_write",
            "mode": mode,
            "backend": "nixl",
            "room": room,
            "delayed_s": round(time.time() - started, 3),
            "triggered": _trigger is not None and _trigger.exists(),
            "started": started,
            "t": time.time(),
            "status": 0 if state == "DONE" else -1,
            "state": state,
            "blocks": pages,
        }
    )
    return state


_nixl_delay = 0.0


def _wrap_agent(agent: Any, rooms: set[int], timeout: float | None) -> None:
    original = agent.transfer
    if getattr(original, "_sglang_harden_latewrite", False):
        return

    def transfer(handle: Any, *args: Any, **kwargs: Any) -> str:
        room, pages = getattr(_tls, "room", None), getattr(_tls, "kv_pages", None)
        if room not in rooms or not pages or args or kwargs:
            return original(handle, *args, **kwargs)
        if timeout is None:
            return _late_nixl(agent, original, handle, room, pages, "blocking")
        threading.Thread(target=_late_nixl, args=(agent, original, handle, room, pages, "timed_out"),
                         daemon=True).start()
        time.sleep(timeout)
        _emit({"event": "engine_timeout", "backend": "nixl", "room": room, "t": time.time(), "timeout_s": timeout})
        return "ERR"

    transfer._sglang_harden_latewrite = True  # type: ignore[attr-defined]
    agent.transfer = transfer


def _patch_nixl_manager(module: ModuleType) -> None:
    global _nixl_delay
    cls = module.NixlKVManager
    if getattr(cls, "_sglang_harden_latewrite", False):
        return
    delay, rooms, timeout = parse(os.environ[ENV])
    _nixl_delay = delay
    _mark_kv_sends(cls, rooms)
    original_init = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        agent = getattr(self, "agent", None)
        if agent is not None:
            _wrap_agent(agent, rooms, timeout)

    cls.__init__ = init
    cls._sglang_harden_latewrite = True


def _learns_rooms_by_rid(original: Any) -> Any:
    @functools.wraps(original)
    def handle_generate_request(self: Any, recv_req: Any, *args: Any, **kwargs: Any) -> Any:
        rid, room = str(getattr(recv_req, "rid", "") or ""), getattr(recv_req, "bootstrap_room", None)
        if _rid_prefix and rid.startswith(_rid_prefix) and room is not None:
            _rooms.add(int(room))
            _emit({"event": "room_learnt", "rid": rid, "room": int(room), "t": time.time()})
        return original(self, recv_req, *args, **kwargs)

    return handle_generate_request


def _patch_scheduler(module: ModuleType) -> None:
    cls = module.Scheduler
    if getattr(cls, "_sglang_harden_latewrite", False):
        return
    parse(os.environ[ENV])
    if _rid_prefix:
        cls.handle_generate_request = _learns_rooms_by_rid(cls.handle_generate_request)
    cls._sglang_harden_latewrite = True


def install() -> None:
    when_imported("sglang.srt.managers.scheduler", _patch_scheduler)
    when_imported("sglang.srt.disaggregation.common.utils", _patch_queue)
    when_imported("sglang.srt.disaggregation.mooncake.conn", _patch_manager)
    when_imported("sglang.srt.disaggregation.nixl.conn", _patch_nixl_manager)
