"""The shape of every ZMQ message a PD KV manager's listener thread reads (prefill's rank port: decode's
registrations, transfer infos, abort notices, staging replies and watermarks, deferred-allocation bootstraps;
decode's: statuses, aux data, drain acks, staging requests and chunk notices), per backend and role, so that a
message these accept cannot raise in the listener of SGLang 0.5.19..0.5.23.

:func:`classify` names a message the way the listener dispatches it (no validation). :func:`check` reads every
frame the pin's listener reads, the way it reads it or stricter (``wire_frames``), then runs the pin's own parsers
(``TransferInfo.from_zmq``, ``KVArgsRegisterInfo.from_zmq``, ``AbortNotification.from_zmq``, ``AbortAck.from_zmq``,
``parse_kv_status_message``) and the pure manager checks the listener runs on what they parse
(``requires_dcp_relayout``, ``prepare_dcp_token_item_lens``, ``_validate_peer_state_layout``); a parser that raises
means the listener would have. The parsers are found at run time on the modules of the manager's own classes
(:class:`Release`): nothing here imports SGLang, and a release without a parser a message type needs drops it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_harden.compat.backends import wire_frames as wf
from sglang_harden.compat.backends.wire_frames import U31, U63, Malformed

KINDS = ("registration", "transfer_info", "abort", "abort_ack", "status", "aux_data", "staging_req", "staging_rsp",
         "watermark", "chunk_ready", "bootstrap", "unknown")
NIXL_GUARD, MORI_GUARD, KV_STATUS = b"NixlMsgGuard", b"MoriMsgGuard", b"KV_STATUS"
TAGS = {b"ABORT": "abort", b"ABORT_ACK": "abort_ack", b"AUX_DATA": "aux_data", b"STAGING_REQ": "staging_req",
        b"STAGING_RSP": "staging_rsp", b"WATERMARK": "watermark", b"CHUNK_READY": "chunk_ready",
        b"BOOTSTRAP": "bootstrap"}
PREFILL_TAGS = ("abort", "staging_rsp", "watermark", "bootstrap")
DECODE_TAGS = {"mooncake": ("aux_data", "chunk_ready", "staging_req", "abort_ack"),
               "nixl": ("chunk_ready", "staging_req", "abort_ack"),
               "mori": ("aux_data", "abort_ack")}
MAX_DESTINATIONS = 1024  # required_dst_info_num: decode ranks per prefill rank of one room
MAX_CHUNKS = 2**16  # a staging chunk index: SGLang appends to three lists up to it, one item at a time (a
# request of 1M tokens in 64-token chunks has 16k)
MAX_DCP = 1024
MAX_REASON = 64 * 1024


@dataclass(frozen=True)
class Shape:
    """What the rules need of an accepted message."""

    kind: str
    room: int | None = None
    key: str | None = None  # the registration / transfer-info key: session id, agent name, engine key
    endpoint: tuple[str, int] | None = None  # the decode address the message claims (reply target)
    required: int | None = None  # a transfer info's required_dst_info_num
    dummy: bool = False
    aux: tuple[int, int, int] | None = None  # AUX_DATA: buffer index, aux index, data length


class Release:
    """The parsers and entry points of one manager's SGLang release, looked up on its classes' modules."""

    def __init__(self, manager: Any) -> None:
        cls = type(manager)
        self.modules = [m for m in (sys.modules.get(k.__module__) for k in cls.__mro__) if m is not None]
        self.transfer_info = self._parser("TransferInfo")
        self.register_info = self._parser("KVArgsRegisterInfo")
        self.abort_notification = self._parser("AbortNotification")  # 0.5.22+
        self.abort_ack = self._parser("AbortAck")  # 0.5.22+
        self.status_parser = hasattr(cls, "parse_kv_status_message")  # 0.5.20+
        self.status_tag: bytes | None = getattr(cls, "kv_status_msg_tag", None)
        self.abort_method = hasattr(cls, "_handle_abort_notification")  # Mooncake: 0.5.22+ (else inline reads)
        self.abort_ack_method = hasattr(cls, "handle_abort_ack_message")  # 0.5.22+
        self.bootstrap_method = hasattr(cls, "_handle_bootstrap_message")  # 0.5.22+
        poll = self._find("KVPoll")
        values = {v for k, v in vars(poll).items() if not k.startswith("_") and isinstance(v, int)} if poll else set()
        self.statuses = frozenset(values or range(5))

    def _find(self, name: str) -> Any:
        for module in self.modules:
            if hasattr(module, name):
                return getattr(module, name)
        return None

    def _parser(self, name: str) -> Callable[[list[bytes]], Any] | None:
        return getattr(self._find(name), "from_zmq", None)


def classify(backend: str, role: str, frames: Sequence[bytes]) -> str:
    """The message type, as the listener of ``backend``/``role`` would dispatch ``frames`` (no validation)."""
    if not frames or not isinstance(frames[0], bytes):
        return "unknown"
    head = frames[0]
    tagged = TAGS.get(head)
    if role == "prefill":
        if tagged in PREFILL_TAGS:
            return tagged
        if backend == "mooncake":
            if head == b"None":
                return "registration"
            return "transfer_info" if head and head.lstrip(b"-").isdigit() else "unknown"
        if head == (NIXL_GUARD if backend == "nixl" else MORI_GUARD) and len(frames) > 1:
            return "registration" if frames[1] == b"None" else "transfer_info"
        return "unknown"
    if tagged in DECODE_TAGS.get(backend, ()):
        return tagged
    if backend == "mooncake":
        return "status" if head.lstrip(b"-").isdigit() else "unknown"
    return "status" if head == (KV_STATUS if backend == "nixl" else MORI_GUARD) else "unknown"


def check(backend: str, role: str, kind: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    """``frames``' shape, or :class:`Malformed` with the reason the listener must not see it."""
    checker = _CHECKS.get((role, kind))
    if checker is None:
        raise Malformed(f"{kind}: not read by the {backend} {role} listener")
    return checker(backend, frames, release, manager)


# ------------------------------------------------------------------------------------------------ prefill side


def _staging_on(manager: Any, role: str) -> bool:
    part = "_staging_ctx" if role == "prefill" else "_staging_handler"
    return bool(getattr(manager, "enable_staging", False)) and getattr(manager, part, None) is not None


def _watermark(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    if not _staging_on(manager, "prefill"):
        raise Malformed("watermark: staging is off here")  # Mooncake reads it anyway: AttributeError on None
    wf.count(frames, 3, 4, "watermark")
    wf.integer(frames, 1, "watermark round", 0, U63)
    wf.integer(frames, 2, "watermark tail", 0, U63)
    if len(frames) > 3:
        wf.ascii_text(frames, 3, "watermark session")
    return Shape("watermark")


def _staging_rsp(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    if not _staging_on(manager, "prefill"):
        raise Malformed("staging_rsp: staging is off here")
    wf.count(frames, 7, 7, "staging_rsp")
    room = wf.integer(frames, 1, "staging_rsp room")
    wf.integer(frames, 2, "staging_rsp chunk", 0, MAX_CHUNKS)
    for index, what in ((3, "offset"), (4, "round"), (5, "end")):
        wf.integer(frames, index, f"staging_rsp {what}", -U63, U63)
    return Shape("staging_rsp", room=room, key=wf.ascii_text(frames, 6, "staging_rsp session"))


def _abort(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    inline = backend == "mooncake" and not release.abort_method  # Mooncake <= 0.5.21 reads frames 1..3 itself
    wf.count(frames, 4 if inline else 2, 5, "abort")
    if len(frames) == 3:
        raise Malformed("abort: an address without a port")
    room = wf.integer(frames, 1, "abort room")
    reply = wf.endpoint(frames, 2, "abort reply") if len(frames) >= 4 else None
    if len(frames) == 5:
        wf.integer(frames, 4, "abort generation", 0, U63)
    if release.abort_notification is not None and _parse(release.abort_notification, list(frames), "abort") is None:
        raise Malformed("abort: the release's parser refuses it")
    return Shape("abort", room=room, endpoint=reply)


def _bootstrap(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    # Only the role-switch-aware receive (Mooncake, MORI) consumes BOOTSTRAP, and only with deferred allocation;
    # anywhere else it falls through to the registration/transfer-info reads and kills the thread.
    if backend == "nixl" or not release.bootstrap_method or getattr(manager, "deferred_bootstrap", None) is None:
        raise Malformed("bootstrap: deferred allocation is off here")
    wf.count(frames, 4, 4, "bootstrap")
    return Shape("bootstrap", room=wf.integer(frames, 1, "bootstrap room"),
                 endpoint=wf.endpoint(frames, 2, "bootstrap reply"))


def _payload(backend: str, frames: Sequence[bytes]) -> Sequence[bytes]:
    """The frames after NIXL's / MORI's guard frame (Mooncake has none)."""
    if backend == "mooncake":
        return frames
    if frames[0] != (NIXL_GUARD if backend == "nixl" else MORI_GUARD):
        raise Malformed("no guard frame")
    return frames[1:]


# the frame count a registration's payload needs (the parser's unconditional reads) and may have
_REGISTRATION_FRAMES = {"mooncake": (10, 32), "nixl": (12, 31), "mori": (11, 31)}
# the integer fields of a registration's payload: index -> (name, lo, hi)
_REGISTRATION_INTS = {
    "mooncake": {7: ("tp rank", 0, U31), 8: ("attn tp size", 1, U31), 9: ("kv item len", 0, U63)},
    "nixl": {8: ("gpu id", 0, U31), 9: ("tp size", 1, U31), 10: ("tp rank", 0, U31), 11: ("kv item len", 0, U63)},
    "mori": {7: ("gpu id", 0, U31), 8: ("tp size", 1, U31), 9: ("tp rank", 0, U31), 10: ("kv item len", 0, U63)},
}
_REGISTRATION_DCP = {"mooncake": (16, 17), "nixl": (21, 22), "mori": (13, 14)}


def _registration(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    p = _payload(backend, frames)
    wf.count(p, *_REGISTRATION_FRAMES[backend], "registration")
    reply = wf.endpoint(p, 1, "registration")
    if backend == "mooncake":
        key: str | None = wf.session_id(p, 3, "registration session id")
        wf.packed_len(p, 4, "registration kv ptrs", 8)
        wf.packed_len(p, 5, "registration aux ptrs", 8)
        wf.optional_integer(p, 15, "registration staging size", 0, U63)
    elif backend == "nixl":
        key = wf.text(p, 3, "registration agent name")
        wf.packed_len(p, 5, "registration kv ptrs", 8)
        wf.packed_len(p, 6, "registration aux ptrs", 8)
        wf.optional_integer(p, 16, "registration slots", 0, U63)
    else:
        key = None  # MORI's key is inside the packed engine descriptor: the parser reads it
    for index, (name, lo, hi) in _REGISTRATION_INTS[backend].items():
        wf.integer(p, index, f"registration {name}", lo, hi)
    size_at, rank_at = _REGISTRATION_DCP[backend]
    dcp_size = wf.optional_integer(p, size_at, "registration dcp size", 1, MAX_DCP) or 1
    dcp_rank = wf.optional_integer(p, rank_at, "registration dcp rank", 0, MAX_DCP) or 0
    if dcp_rank >= dcp_size:
        raise Malformed("registration: dcp rank outside dcp size")
    info = _parse(release.register_info, list(p), "registration")
    if backend == "mori":
        key = getattr(info, "engine_key", None)
        if not isinstance(key, str) or not key:
            raise Malformed("registration: no engine key")
    _peer_checks(backend, info, manager)
    return Shape("registration", key=key, endpoint=reply)


def _peer_checks(backend: str, info: Any, manager: Any) -> None:
    """The pure manager calls the listener makes on a parsed registration, which raise on a peer it cannot serve."""
    size, rank = getattr(info, "dst_dcp_size", None), getattr(info, "dst_dcp_rank", None)
    relayout = False
    if size is not None and rank is not None and hasattr(manager, "requires_dcp_relayout"):
        relayout = bool(_call(manager.requires_dcp_relayout, "registration: DCP topology", size, rank))
    kv_args = getattr(manager, "kv_args", None)
    item_lens = list(getattr(kv_args, "kv_item_lens", None) or [])
    if relayout and backend != "nixl" and hasattr(manager, "prepare_dcp_token_item_lens"):
        prepare = manager.prepare_dcp_token_item_lens
        if len(inspect.signature(prepare).parameters) >= 2:  # 0.5.20+: draft entries keep their own length
            draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
            lens = [info.dst_kv_item_len] * (len(item_lens) - draft) + [None] * draft
            _call(prepare, "registration: DCP geometry", lens, size)
        else:
            _call(prepare, "registration: DCP geometry", [info.dst_kv_item_len] * len(item_lens))
    if backend == "nixl" and len(getattr(info, "dst_kv_item_lens", item_lens)) < len(item_lens):
        raise Malformed("registration: fewer KV regions than this prefill")  # _prepare_payload_xfer raises
    if backend == "mooncake" and hasattr(manager, "_validate_peer_state_layout"):
        _call(manager._validate_peer_state_layout, "registration: state layout", info)


# the frame count a transfer info's payload needs (the listener's and the parser's unconditional reads) and may have
_TRANSFER_FRAMES = {"mooncake": (8, 16), "nixl": (7, 15), "mori": (6, 15)}


def _transfer_info(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    p = _payload(backend, frames)
    wf.count(p, *_TRANSFER_FRAMES[backend], "transfer_info")
    room = wf.integer(p, 0, "transfer_info room")
    reply = wf.endpoint(p, 1, "transfer_info")
    if backend == "mooncake":
        key = wf.session_id(p, 3, "transfer_info session id")
        required = wf.integer(p, 7, "transfer_info required", 1, MAX_DESTINATIONS)
        if p[4] or p[5]:
            wf.packed_len(p, 4, "transfer_info kv indices", 4)
            wf.integer(p, 5, "transfer_info aux index", 0, U31)
        wf.optional_integer(p, 8, "transfer_info prefix len", 0, U63)
        if len(p) > 9:
            wf.packed_len(p, 9, "transfer_info device kv indices", 4)
    elif backend == "nixl":
        key = wf.text(p, 3, "transfer_info agent name")
        wf.packed_len(p, 4, "transfer_info kv indices", 4)
        wf.integer(p, 5, "transfer_info aux index", -1, U31)
        required = wf.integer(p, 6, "transfer_info required", 1, MAX_DESTINATIONS)
        wf.optional_integer(p, 8, "transfer_info prefix len", 0, U63)
        wf.optional_integer(p, 9, "transfer_info dummy flag", 0, 1)
    else:
        key = wf.text(p, 3, "transfer_info engine key")
        wf.packed_len(p, 4, "transfer_info kv indices", 4)
        wf.optional_integer(p, 5, "transfer_info aux index", -1, U31)
        required = wf.optional_integer(p, 7, "transfer_info required", 1, MAX_DESTINATIONS) or 1
        if len(p) > 7 and not p[7]:
            raise Malformed("transfer_info required: empty")
        wf.optional_integer(p, 8, "transfer_info prefix len", 0, U63)
    info = _parse(release.transfer_info, list(p), "transfer_info")
    if getattr(info, "required_dst_info_num", required) != required or getattr(info, "room", room) != room:
        raise Malformed("transfer_info: the release's parser reads it differently")
    dummy = getattr(info, "is_dummy", False)
    return Shape("transfer_info", room=room, key=key, endpoint=reply, required=required,
                 dummy=bool(dummy() if callable(dummy) else dummy))


# ------------------------------------------------------------------------------------------------- decode side


def _aux_data(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    wf.count(frames, 6, 6, "aux_data")
    room = wf.integer(frames, 1, "aux_data room")
    buffer_index = wf.integer(frames, 2, "aux_data buffer index", 0, U31)
    aux_index = wf.integer(frames, 3, "aux_data aux index", 0, U63)
    length = int.from_bytes(wf.packed_len(frames, 4, "aux_data length", 4, exact=4), "big")
    if length != len(frames[5]):
        raise Malformed("aux_data: length frame disagrees with the data")
    return Shape("aux_data", room=room, aux=(buffer_index, aux_index, length))


def _status(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    tag = {"mooncake": None, "nixl": KV_STATUS, "mori": MORI_GUARD}[backend]
    if backend == "nixl" and (not release.status_parser or release.status_tag != KV_STATUS):
        raise Malformed("status: this release's NIXL reports statuses through NIXL, not this socket")
    p = frames if tag is None else frames[1:]
    if backend == "mooncake" and not release.status_parser:
        wf.count(p, 3, 3, "status")  # 0.5.19 unpacks exactly three frames
    else:
        wf.count(p, 3, 4, "status")
    room = wf.integer(p, 0, "status room")
    if wf.integer(p, 1, "status value", 0, 64) not in release.statuses:
        raise Malformed("status: not a KVPoll value")
    wf.integer(p, 2, "status prefill rank", 0, U31)
    if len(p) > 3:
        if len(p[3]) > MAX_REASON:
            raise Malformed("status: reason too long")
        if not release.status_parser:  # MORI 0.5.19 decodes the reason strictly
            try:
                p[3].decode("utf-8")
            except UnicodeDecodeError:
                raise Malformed("status: reason not UTF-8") from None
    if release.status_parser:
        parsed = _call(manager.parse_kv_status_message, "status", list(frames))
        if parsed is None or parsed[0] != room:
            raise Malformed("status: the release's parser refuses it")
    return Shape("status", room=room)


def _abort_ack(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    if backend == "mori" and not release.abort_ack_method:
        raise Malformed("abort_ack: this release's MORI has no drain acks")
    wf.count(frames, 2, 4, "abort_ack")
    room = wf.integer(frames, 1, "abort_ack room")
    if len(frames) > 2:
        wf.integer(frames, 2, "abort_ack prefill rank", 0, U31)
    if len(frames) > 3:
        wf.integer(frames, 3, "abort_ack generation", 0, U63)
    if release.abort_ack is not None and len(frames) > 2 and _parse(release.abort_ack, list(frames), "ack") is None:
        raise Malformed("abort_ack: the release's parser refuses it")
    return Shape("abort_ack", room=room)


def _staging_req(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    if not _staging_on(manager, "decode"):
        raise Malformed("staging_req: staging is off here")  # 0.5.19's listeners assert on the handler
    wf.count(frames, 5, 6, "staging_req")
    room = wf.integer(frames, 1, "staging_req room")
    wf.integer(frames, 2, "staging_req chunk", 0, MAX_CHUNKS)
    wf.integer(frames, 3, "staging_req pages", 0, U31)
    wf.ascii_text(frames, 4, "staging_req session")
    wf.optional_integer(frames, 5, "staging_req pp rank", 0, U31)
    return Shape("staging_req", room=room)


def _chunk_ready(backend: str, frames: Sequence[bytes], release: Release, manager: Any) -> Shape:
    if not _staging_on(manager, "decode"):
        raise Malformed("chunk_ready: staging is off here")  # up to 0.5.22 Mooncake asserts on the handler
    wf.count(frames, 6, 7, "chunk_ready")
    room = wf.integer(frames, 1, "chunk_ready room")
    wf.integer(frames, 2, "chunk_ready chunk", 0, MAX_CHUNKS)
    wf.integer(frames, 3, "chunk_ready page start", 0, U31)
    wf.integer(frames, 4, "chunk_ready pages", 0, U31)
    wf.ascii_text(frames, 5, "chunk_ready writer")
    wf.optional_integer(frames, 6, "chunk_ready rank", 0, U31)
    return Shape("chunk_ready", room=room)


def _parse(parser: Callable[[list[bytes]], Any] | None, frames: list[bytes], what: str) -> Any:
    if parser is None:
        raise Malformed(f"{what}: this release has no parser for it")
    return _call(parser, what, frames)


def _call(fn: Callable[..., Any], what: str, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - the listener would have raised the same
        raise Malformed(f"{what}: the release refuses it") from None


Checker = Callable[[str, Sequence[bytes], Release, Any], Shape]
_CHECKS: dict[tuple[str, str], Checker] = {
    ("prefill", "watermark"): _watermark, ("prefill", "staging_rsp"): _staging_rsp, ("prefill", "abort"): _abort,
    ("prefill", "bootstrap"): _bootstrap, ("prefill", "registration"): _registration,
    ("prefill", "transfer_info"): _transfer_info, ("decode", "aux_data"): _aux_data, ("decode", "status"): _status,
    ("decode", "abort_ack"): _abort_ack, ("decode", "staging_req"): _staging_req,
    ("decode", "chunk_ready"): _chunk_ready,
}
