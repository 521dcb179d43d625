"""What a PD KV manager's ZMQ listener may be told, and by whom.

Each KV manager (prefill or decode; Mooncake, NIXL, MORI) reads one PULL socket on one thread that trusts every
frame. The verifying receive (the manager's class-swapped socket) checks the message's auth frame, strips it and
asks :class:`WireRules` whether the rest may reach SGLang: its shape (``wire_shapes``: what the pin's listener
reads, so that nothing accepted raises there) and these rules, with the authenticated sender's instance id (None
for an unsigned message):

(a) registration: a key (Mooncake session id, NIXL agent name, MORI engine key) already registered with other
    content is replaced only by the authenticated sender that registered it (signed by the same process), or once
    SGLang itself has given the old peer up (Mooncake: the session failed; a restarted decode may reuse its
    ``host:port``); a key its registrant signed is never touched by an unsigned message; unsigned, the first
    registration wins (Mooncake then keeps its peers as NIXL and MORI already do).
(b) transfer info: all of a room's agree on ``required_dst_info_num``, no more keys than that, a non-dummy one
    names a registered peer (else Mooncake's transfer worker dies on it) and carries the reply address that peer
    registered with (decode sends both from the same ``local_ip:rank_port``); a signed one names a key its sender
    registered; a key registered signed takes no unsigned transfer info.
(c) AUX_DATA (decode): the write of ``len(data)`` bytes at ``aux_data_ptrs[b] + aux_item_lens[b] * aux_index``
    stays inside buffer ``b`` (else a ctypes write anywhere: SIGSEGV), for a room decode knows.
(d) ABORT (prefill): a reply address must be a decode endpoint of a transfer info of that room, or one a peer
    registered from (signed: one its sender registered from), else prefill would connect to and ack any
    ``ip:port`` (and keep a socket for each); a signed one for a room with transfer infos comes from one of
    their senders.
(e) statuses, CHUNK_READY, STAGING_REQ (decode): only for a room decode knows. ABORT_ACK: its shape only, no room
    rule: SGLang records an ack only for a room it holds for drain acks, and the lifecycle
    guard's drain-ack ledger judges the rest itself (live transfer, generation, targeted rank; bounded), including
    rooms SGLang no longer knows whose pages the guard still keeps in quarantine for that ack and a targeted
    rank's ack that arrives before decode's notice (a room rule here dropped exactly those: the quarantine then
    held their pages for good).

State is bounded: registrants and rooms are LRU-capped, a room's record ages out and restarts when SGLang no
longer holds the room. A key SGLang still holds whose record was forgotten keeps its first registration; a signed
peer idle through ``MAX_KEYS`` newer registrations has its next transfer info refused, and registers again once
that request times out (SGLang's receiver drops its cached connection then). Never modifies a frame; the reasons
carry no frame bytes. Called on the listener thread.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_harden.compat.backends.wire_frames import Malformed
from sglang_harden.compat.backends.wire_shapes import Release, Shape, check, classify

BACKENDS = ("mooncake", "nixl", "mori")
ROLES = ("prefill", "decode")
MAX_FRAMES = 32
MIB = 1024 * 1024
# total bytes per message type; a transfer info's is derived from the pool (``WireRules._transfer_cap``)
SIZE_CAPS = {"registration": 16 * MIB, "status": 128 * 1024, "aux_data": MIB, "transfer_info": 64 * MIB}
DEFAULT_CAP = 64 * 1024
MAX_KEYS = 65536  # registered peers remembered (least recently used forgotten first)
MAX_ROOMS = 65536  # rooms whose transfer-info endpoints are remembered for late abort notices
ROOM_MAX_AGE_S = 3600.0


@dataclass
class _Registrant:
    sender: bytes | None
    digest: bytes
    endpoint: tuple[str, int] | None


@dataclass
class _Room:
    seen: float
    endpoints: set[tuple[str, int]] = field(default_factory=set)
    senders: set[bytes | None] = field(default_factory=set)  # who sent the room's transfer infos


class WireRules:
    """The shape checks and who-may-say-what rules of the ZMQ messages one KV manager receives."""

    def __init__(self, backend: str, role: str, manager: Any, *, clock: Callable[[], float] = time.monotonic) -> None:
        if backend not in BACKENDS or role not in ROLES:
            raise ValueError(f"no wire rules for a {backend!r} {role!r} manager")
        self.backend, self.role, self._manager, self._clock = backend, role, manager, clock
        self._release: Release | None = None  # the manager may be half-built now: looked up on first use
        self._transfer_cap_bytes: int | None = None
        self._registrants: OrderedDict[str, _Registrant] = OrderedDict()
        self._endpoints: Counter[tuple[str, int]] = Counter()  # the registrants' reply addresses
        self._sender_endpoints: Counter[tuple[bytes | None, tuple[str, int]]] = Counter()
        self._rooms: OrderedDict[int, _Room] = OrderedDict()

    def kind(self, frames: list[bytes]) -> str:
        return classify(self.backend, self.role, frames)

    def problem(self, frames: list[bytes], sender: bytes | None) -> str | None:
        """None: the message may reach SGLang's listener; else a short reason why it is dropped."""
        if not isinstance(frames, list | tuple) or not frames:
            return "empty message"
        if not all(isinstance(f, bytes) for f in frames):
            return "a frame is not bytes"
        kind = classify(self.backend, self.role, frames)
        if kind == "unknown":
            return "unknown message type"
        if len(frames) > MAX_FRAMES:
            return f"{kind}: too many frames"
        if sum(len(f) for f in frames) > self._size_cap(kind):
            return f"{kind}: too large"
        if self._release is None:
            self._release = Release(self._manager)
        try:
            shape = check(self.backend, self.role, kind, frames, self._release, self._manager)
        except Malformed as exc:
            return str(exc)
        rule = _RULES.get((self.role, kind))
        reason = rule(self, shape, frames, sender) if rule is not None else None
        if reason is None:
            self._remember(shape, frames, sender)
        return reason

    # ------------------------------------------------------------------------------------------- size caps

    def _size_cap(self, kind: str) -> int:
        if kind == "transfer_info":
            return self._transfer_cap()
        if kind == "aux_data":
            items = _ints(getattr(getattr(self._manager, "kv_args", None), "aux_item_lens", None))
            return max(items) + 4096 if items else SIZE_CAPS["aux_data"]
        return SIZE_CAPS.get(kind, DEFAULT_CAP)

    def _transfer_cap(self) -> int:
        """The largest frame of a transfer info is its page indices (4 bytes a page of the longest request, and a
        request never holds more tokens than prefill's pool): 16 bytes a pool token (page indices, device page
        indices, state indices, with room to spare) plus 1 MiB; 64 MiB while the pool is not readable."""
        if self._transfer_cap_bytes is None:
            kv_args = getattr(self._manager, "kv_args", None)
            lens = _ints(getattr(kv_args, "kv_data_lens", None))
            items = _ints(getattr(kv_args, "kv_item_lens", None))
            page_size = getattr(kv_args, "page_size", None)
            if not lens or not items or not items[0] or not isinstance(page_size, int) or page_size <= 0:
                return SIZE_CAPS["transfer_info"]
            self._transfer_cap_bytes = 16 * (lens[0] // items[0]) * page_size + MIB
        return self._transfer_cap_bytes

    # ------------------------------------------------------------------------------------------------ rules

    def _registration(self, shape: Shape, frames: Sequence[bytes], sender: bytes | None) -> str | None:
        known = self._registrants.get(shape.key or "")
        if known is None:
            if self._registered(shape.key or "") and not self._given_up(shape.key or ""):
                return "registration: the key is registered already (its record aged out: the first one stays)"
            return None
        if known.sender is not None and sender is None:
            return "registration: unsigned, for a peer that registered signed"
        if known.digest == _digest(frames) or (sender is not None and known.sender == sender):
            return None
        if self._given_up(shape.key or ""):
            return None
        if sender is None:
            return "registration: the key is registered already (unsigned: the first registration wins)"
        return "registration: would replace a peer another sender registered"

    def _registered(self, key: str) -> bool:
        return _holds(getattr(self._manager, "decode_kv_args_table", None), key)

    def _given_up(self, key: str) -> bool:
        """SGLang has marked the peer failed (Mooncake's ``failed_sessions``): a new registration may take over."""
        failed = getattr(self._manager, "failed_sessions", None)
        try:
            return failed is not None and key in failed
        except Exception:  # noqa: BLE001 - a set being changed by the transfer worker: not given up
            return False

    def _transfer_info(self, shape: Shape, frames: Sequence[bytes], sender: bytes | None) -> str | None:
        key, required = shape.key or "", shape.required or 1
        known = self._registrants.get(key)
        if sender is not None and (known is None or known.sender != sender):
            return "transfer_info: for a peer this sender did not register"
        if sender is None and known is not None and known.sender is not None:
            return "transfer_info: unsigned, for a peer that registered signed"
        table = getattr(self._manager, "decode_kv_args_table", None)
        if not shape.dummy and table is not None and key not in table:
            return "transfer_info: for an unregistered peer"
        if not shape.dummy and known is not None and known.endpoint not in (None, shape.endpoint):
            return "transfer_info: a reply address other than the one its peer registered from"
        infos = _snapshot(getattr(self._manager, "transfer_infos", None), shape.room)
        if infos is None:
            return "transfer_info: the room's destinations could not be read"
        if any(getattr(info, "required_dst_info_num", required) != required for info in infos.values()):
            return "transfer_info: the room's transfer infos disagree on required_dst_info_num"
        if len(set(infos) | {key}) > required:
            return "transfer_info: more destinations than the room's required_dst_info_num"
        return None

    def _abort(self, shape: Shape, frames: Sequence[bytes], sender: bytes | None) -> str | None:
        record = self._live_room(shape.room)
        if sender is not None and record is not None and sender not in record.senders:
            return "abort: signed by none of the room's decode peers"
        if shape.endpoint is None or shape.endpoint in self._room_endpoints(shape.room):
            return None
        # a room aborted before its transfer info came (or after SGLang dropped it): a registered decode's address
        if self._endpoints[shape.endpoint] if sender is None else self._sender_endpoints[(sender, shape.endpoint)]:
            return None
        return "abort: the reply address is no decode endpoint of the room nor of a registered peer"

    def _staging_rsp(self, shape: Shape, frames: Sequence[bytes], sender: bytes | None) -> str | None:
        infos = _snapshot(getattr(self._manager, "transfer_infos", None), shape.room)
        return None if infos and shape.key in infos else "staging_rsp: for no destination of a known room"

    def _known_room(self, shape: Shape, frames: Sequence[bytes], sender: bytes | None) -> str | None:
        if shape.kind == "abort_ack":
            return None  # no room rule: (e) above
        if not _holds(getattr(self._manager, "request_status", None), shape.room):
            return f"{shape.kind}: for a room this decode does not know"
        inline_status = self._release is not None and not self._release.status_parser
        if shape.kind == "status" and self.backend == "mooncake" and inline_status:
            table = getattr(self._manager, "required_prefill_response_num_table", None)
            if table is not None and shape.room not in table:  # 0.5.19 indexes it for every Success
                return "status: for a room without an expected response count"
        return None

    def _aux_data(self, shape: Shape, frames: Sequence[bytes], sender: bytes | None) -> str | None:
        buffer_index, aux_index, length = shape.aux or (0, 0, 0)
        kv_args = getattr(self._manager, "kv_args", None)
        ptrs = _ints(getattr(kv_args, "aux_data_ptrs", None))
        lens = _ints(getattr(kv_args, "aux_data_lens", None))
        items = _ints(getattr(kv_args, "aux_item_lens", None))
        if buffer_index >= min(len(ptrs), len(lens), len(items)):
            return "aux_data: no such aux buffer"
        if length > items[buffer_index]:
            return "aux_data: longer than the buffer's item"
        if aux_index * items[buffer_index] + length > lens[buffer_index]:
            return "aux_data: the write would end past the buffer"
        return self._known_room(shape, frames, sender)

    # ------------------------------------------------------------------------------------------------ state

    def _remember(self, shape: Shape, frames: Sequence[bytes], sender: bytes | None) -> None:
        if shape.kind == "registration" and shape.key is not None:
            known = self._registrants.get(shape.key)
            digest = _digest(frames)
            if known is not None and known.digest == digest and sender != known.sender:
                self._registrants.move_to_end(shape.key)  # the same registration again, from someone else
            else:
                self._set_registrant(shape.key, _Registrant(sender, digest, shape.endpoint))
        elif shape.kind == "transfer_info" and shape.room is not None and shape.endpoint is not None:
            now = self._clock()
            room = self._rooms.pop(shape.room, None)
            if room is None or not self._sglang_holds(shape.room):
                room = _Room(now)  # a new lifetime of this room number
            room.seen = now
            room.endpoints.add(shape.endpoint)
            room.senders.add(sender)
            self._rooms[shape.room] = room
            if shape.key in self._registrants:
                self._registrants.move_to_end(shape.key)
            while self._rooms and (len(self._rooms) > MAX_ROOMS
                                   or now - next(iter(self._rooms.values())).seen > ROOM_MAX_AGE_S):
                self._rooms.popitem(last=False)

    def _set_registrant(self, key: str, registrant: _Registrant | None) -> None:
        """Record (None: forget) ``key``'s registrant, keeping the reply-address counts in step."""
        old = self._registrants.pop(key, None)
        for record, step in ((old, -1), (registrant, 1)):
            if record is not None and record.endpoint is not None:
                _count(self._endpoints, record.endpoint, step)
                _count(self._sender_endpoints, (record.sender, record.endpoint), step)
        if registrant is not None:
            self._registrants[key] = registrant
            while len(self._registrants) > MAX_KEYS:
                self._set_registrant(next(iter(self._registrants)), None)

    def _sglang_holds(self, room: int) -> bool:
        infos = _snapshot(getattr(self._manager, "transfer_infos", None), room)
        return bool(infos)

    def _room_endpoints(self, room: int | None) -> list[tuple[str, int]]:
        found = [(info.endpoint, info.dst_port) for info in (_snapshot(getattr(self._manager, "transfer_infos", None),
                                                                       room) or {}).values()
                 if hasattr(info, "endpoint") and hasattr(info, "dst_port")]
        record = self._live_room(room)
        if record is not None:
            found.extend(record.endpoints)
        return found

    def _live_room(self, room: int | None) -> _Room | None:
        record = self._rooms.get(room) if room is not None else None
        return record if record is not None and self._clock() - record.seen <= ROOM_MAX_AGE_S else None


def _digest(frames: Sequence[bytes]) -> bytes:
    h = hashlib.sha256()
    for f in frames:
        h.update(len(f).to_bytes(8, "little"))
        h.update(f)
    return h.digest()


def _holds(table: Any, room: int | None) -> bool:
    try:
        return table is not None and room in table
    except Exception:  # noqa: BLE001 - a store that cannot answer: not known
        return False


def _snapshot(table: Any, room: int | None) -> dict[Any, Any] | None:
    """A copy of ``table[room]`` (SGLang's ``transfer_infos``; other threads pop rooms while we read)."""
    if table is None:
        return {}
    for _ in range(3):
        try:
            return dict(table.get(room) or {})
        except RuntimeError:  # changed size during the copy
            continue
    return None


def _ints(value: Any) -> list[int]:
    try:
        return [int(v) for v in value] if value is not None else []
    except (TypeError, ValueError):
        return []


def _count(counter: Counter[Any], key: Any, step: int) -> None:
    counter[key] += step
    if counter[key] <= 0:
        del counter[key]


Rule = Callable[[WireRules, Shape, Sequence[bytes], bytes | None], str | None]
_RULES: dict[tuple[str, str], Rule] = {
    ("prefill", "registration"): WireRules._registration,
    ("prefill", "transfer_info"): WireRules._transfer_info,
    ("prefill", "abort"): WireRules._abort,
    ("prefill", "staging_rsp"): WireRules._staging_rsp,
    ("decode", "aux_data"): WireRules._aux_data,
    ("decode", "status"): WireRules._known_room,
    ("decode", "abort_ack"): WireRules._known_room,
    ("decode", "chunk_ready"): WireRules._known_room,
    ("decode", "staging_req"): WireRules._known_room,
}
