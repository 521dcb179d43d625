"""The wire rules of the PD side channels (``compat/backends/wire_rules.py``), without SGLang.

A stand-in KV manager whose module carries minimal parsers in SGLang's shape (the rules look them up on the
manager's class module, as on a real pin) and a ``deliver`` that applies an admitted message the way SGLang's
listener does (registration -> ``decode_kv_args_table``, transfer info -> ``transfer_infos[room][key]``), so that
each refusal is shown against what the same message does when admitted. The real listeners of the CI pins are
fuzzed behind the same rules in ``tests/integration/test_wire_fuzz_inprocess.py``.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from sglang_harden.compat.backends import wire_rules
from sglang_harden.compat.backends.wire_rules import WireRules
from sglang_harden.compat.backends.wire_shapes import classify

S1, S2 = b"\x01" * 16, b"\x02" * 16
DECODE = ("10.0.0.5", 40001)
VICTIM, OTHER = "10.0.0.5:15001", "10.6.6.6:16001"
NIXL_GUARD, MORI_GUARD = b"NixlMsgGuard", b"MoriMsgGuard"


# ------------------------------------------------------------------------------------------ a stand-in release

class KVPoll:
    Failed, Bootstrapping, WaitingForInput, Transferring, Success = range(5)


class TransferInfo:
    """Mooncake's field order: room, ip, port, session, kv indices, aux index, state, required, prefix, device."""

    def __init__(self, msg: list[bytes]) -> None:
        self.room = int(msg[0].decode("ascii"))
        self.endpoint, self.dst_port = msg[1].decode("ascii"), int(msg[2].decode("ascii"))
        self.mooncake_session_id = msg[3].decode("ascii")
        self.is_dummy = msg[4] == b"" and msg[5] == b""
        self.required_dst_info_num = int(msg[7].decode("ascii"))

    @classmethod
    def from_zmq(cls, msg: list[bytes]) -> TransferInfo:
        return cls(msg)


class KVArgsRegisterInfo:
    def __init__(self, msg: list[bytes]) -> None:
        self.mooncake_session_id = msg[3].decode("ascii")
        self.dst_kv_ptrs = list(struct.unpack(f"{len(msg[4]) // 8}Q", msg[4]))
        self.dst_kv_item_len = int(msg[9].decode("ascii"))

    @classmethod
    def from_zmq(cls, msg: list[bytes]) -> KVArgsRegisterInfo:
        return cls(msg)


class MooncakeKVManager:
    def __init__(self, role: str) -> None:
        self.role = role
        self.kv_args = SimpleNamespace(kv_data_lens=[64 * 256], kv_item_lens=[256], page_size=1,
                                       aux_data_ptrs=[0x1000, 0x2000], aux_data_lens=[64 * 8, 32 * 4],
                                       aux_item_lens=[8, 4])
        self.decode_kv_args_table: dict[str, Any] = {}
        self.transfer_infos: dict[int, dict[str, Any]] = {}
        self.failed_sessions: set[str] = set()
        self.request_status: dict[int, int] = {1: KVPoll.WaitingForInput, 2: KVPoll.WaitingForInput}
        self.required_prefill_response_num_table = {1: 1, 2: 1}
        self._deferred_abort_ack_tracker: dict[int, Any] = {}

    def parse_kv_status_message(self, msg: list[bytes]) -> tuple[int, int, int, str] | None:
        try:
            return int(msg[0]), int(msg[1]), int(msg[2]), ""
        except (ValueError, IndexError):
            return None


@pytest.fixture(scope="module", autouse=True)
def release_module() -> Iterator[None]:
    module = ModuleType("wire_rules_fake_conn")
    for cls in (KVPoll, TransferInfo, KVArgsRegisterInfo, MooncakeKVManager):
        cls.__module__ = module.__name__
        setattr(module, cls.__name__, cls)
    sys.modules[module.__name__] = module
    yield
    del sys.modules[module.__name__]


@pytest.fixture
def prefill() -> tuple[WireRules, MooncakeKVManager]:
    mgr = MooncakeKVManager("prefill")
    return WireRules("mooncake", "prefill", mgr), mgr


@pytest.fixture
def decode() -> tuple[WireRules, MooncakeKVManager]:
    mgr = MooncakeKVManager("decode")
    return WireRules("mooncake", "decode", mgr), mgr


# ------------------------------------------------------------------------------------------------ messages

def registration(key: str = VICTIM, ptr: int = 0xAAAA0000, ip: str = DECODE[0], port: int = DECODE[1]) -> list[bytes]:
    return [b"None", ip.encode(), str(port).encode(), key.encode(), struct.pack("2Q", ptr, ptr + 0x1000),
            struct.pack("Q", 0xBBBB0000), b"", b"0", b"1", b"256"]


def transfer_info(room: int = 1, key: str = VICTIM, required: int = 1, ip: str = DECODE[0],
                  port: int = DECODE[1], dummy: bool = False) -> list[bytes]:
    pages = b"" if dummy else struct.pack("4i", 0, 1, 2, 3)
    return [str(room).encode(), ip.encode(), str(port).encode(), key.encode(), pages, b"" if dummy else b"0", b"",
            str(required).encode(), b"0"]


def deliver(rules: WireRules, mgr: MooncakeKVManager, frames: list[bytes], sender: bytes | None) -> str | None:
    """The rules' verdict; an admitted registration or transfer info lands where SGLang's listener puts it."""
    reason = rules.problem(frames, sender)
    if reason is None and frames[0] == b"None":
        mgr.decode_kv_args_table[frames[3].decode()] = KVArgsRegisterInfo(frames)
    elif reason is None and frames[0].isdigit():
        mgr.transfer_infos.setdefault(int(frames[0]), {})[frames[3].decode()] = TransferInfo(frames)
    return reason


def victim_ptr(mgr: MooncakeKVManager) -> int:
    return int(mgr.decode_kv_args_table[VICTIM].dst_kv_ptrs[0])


# --------------------------------------------------------------------------------------------- what it is

@pytest.mark.parametrize(("backend", "role", "frames", "kind"), [
    ("mooncake", "prefill", [b"None", b"x"], "registration"),
    ("mooncake", "prefill", [b"17", b"x"], "transfer_info"),
    ("mooncake", "prefill", [b"ABORT", b"1"], "abort"),
    ("mooncake", "prefill", [b"x"], "unknown"),
    ("nixl", "prefill", [NIXL_GUARD, b"None"], "registration"),
    ("nixl", "prefill", [NIXL_GUARD, b"5"], "transfer_info"),
    ("nixl", "prefill", [MORI_GUARD, b"5"], "unknown"),
    ("mori", "prefill", [MORI_GUARD, b"None"], "registration"),
    ("mooncake", "decode", [b"5", b"4", b"0"], "status"),
    ("mooncake", "decode", [b"AUX_DATA"], "aux_data"),
    ("nixl", "decode", [b"KV_STATUS", b"5"], "status"),
    ("nixl", "decode", [b"AUX_DATA"], "unknown"),
    ("mori", "decode", [MORI_GUARD, b"5"], "status"),
    ("mori", "decode", [b"ABORT"], "unknown"),
    ("mooncake", "decode", [], "unknown"),
])
def test_kind_names_what_the_listener_would_dispatch(backend: str, role: str, frames: list[bytes], kind: str) -> None:
    assert classify(backend, role, frames) == kind


def test_unknown_backend_or_role_has_no_rules() -> None:
    with pytest.raises(ValueError):
        WireRules("tcp", "prefill", object())
    with pytest.raises(ValueError):
        WireRules("mooncake", "router", object())


# ----------------------------------------------------------------------------------------- malformed input

@pytest.mark.parametrize("frames", [
    [b"x"], [b"None"], [b"ABORT"], [b"1"], [b"None", b"10.0.0.5", b"1"], [b""], [],
    [b"ABORT", b"1", b"10.0.0.5"],  # an address without a port
    [b"ABORT", b"01"], [b"ABORT", b"+1"], [b"ABORT", "٣".encode()], [b"ABORT", str(2**64).encode()],
    [b"ABORT", b"9" * 5000],
    transfer_info(key="x"),  # a Mooncake session id without a port: prefill's scheduler thread dies on it
    transfer_info(key="h:99999"),
    transfer_info(required=0), transfer_info(port=70000), transfer_info(ip="10.0.0.5 "),
    registration()[:9], registration()[:4] + [b"\x00" * 7] + registration()[5:],  # pointers not 8-byte items
    registration() + [b""] * 30,  # too many frames
])
def test_malformed_prefill_messages_are_refused(prefill: tuple[WireRules, MooncakeKVManager],
                                                frames: list[bytes]) -> None:
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), None) is None
    assert rules.problem(frames, None) is not None


@pytest.mark.parametrize("frames", [
    [b"AUX_DATA"], [b"x"], [b"1", b"4"], [b"1", b"4", b"0", b"x", b"y"], [b"1", b"9", b"0"], [b"1", b"4", b"-1"],
    [b"ABORT_ACK", b"x", b"y"], [b"STAGING_REQ"], [b"CHUNK_READY", b"1"],
])
def test_malformed_decode_messages_are_refused(decode: tuple[WireRules, MooncakeKVManager],
                                               frames: list[bytes]) -> None:
    rules, _ = decode
    assert rules.problem(frames, None) is not None


def test_a_frame_that_is_not_bytes_is_refused(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, _ = prefill
    assert rules.problem([b"ABORT", memoryview(b"1")], None) == "a frame is not bytes"  # type: ignore[list-item]


def test_size_caps(prefill: tuple[WireRules, MooncakeKVManager], monkeypatch: pytest.MonkeyPatch) -> None:
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), None) is None
    pool_tokens = 64  # kv_data_lens // kv_item_lens * page_size
    cap = 16 * pool_tokens + wire_rules.MIB
    big = transfer_info()
    big[4] = b"\x00" * (cap // 4 * 4)
    assert rules.problem(big, None) == "transfer_info: too large"
    assert rules.problem([b"ABORT", b"1", b"10.0.0.5", b"1" + b"0" * 70_000], None) == "abort: too large"


# ---------------------------------------------------------------------------------------------- registration

def test_unsigned_first_registration_wins(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), None) is None
    assert deliver(rules, mgr, registration(), None) is None  # the same one again (a new connection pool entry)
    forged = registration(ptr=0xDEAD0000, ip="10.6.6.6")
    assert "first registration wins" in (deliver(rules, mgr, forged, None) or "")
    assert victim_ptr(mgr) == 0xAAAA0000
    vanilla = MooncakeKVManager("prefill")  # the same two messages, no rules: the forgery replaces the victim
    vanilla.decode_kv_args_table[VICTIM] = KVArgsRegisterInfo(registration())
    vanilla.decode_kv_args_table[VICTIM] = KVArgsRegisterInfo(forged)
    assert victim_ptr(vanilla) == 0xDEAD0000


def test_only_the_signed_registrant_replaces_its_registration(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), S1) is None
    assert "another sender" in (deliver(rules, mgr, registration(ptr=0xDEAD0000), S2) or "")
    assert "unsigned" in (deliver(rules, mgr, registration(ptr=0xDEAD0000), None) or "")
    assert "unsigned" in (deliver(rules, mgr, registration(), None) or ""), "a signed peer signs everything"
    assert deliver(rules, mgr, registration(), S2) is None, "the same content again changes nothing"
    assert deliver(rules, mgr, registration(ptr=0xCCCC0000), S1) is None
    assert victim_ptr(mgr) == 0xCCCC0000
    assert "another sender" in (deliver(rules, mgr, registration(ptr=0xDEAD0000), S2) or ""), "S1 still owns it"


def test_a_failed_session_may_be_registered_anew(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), S1) is None
    restarted = registration(ptr=0xCCCC0000)
    assert deliver(rules, mgr, restarted, S2) is not None
    mgr.failed_sessions.add(VICTIM)  # SGLang gave the old process up (its writes failed)
    assert deliver(rules, mgr, restarted, S2) is None
    mgr.failed_sessions.clear()  # Mooncake's registration un-blacklists the session
    assert deliver(rules, mgr, registration(ptr=0xDEAD0000), S1) is not None, "S2 owns it now"
    assert deliver(rules, mgr, transfer_info(), S2) is None


def test_a_registration_whose_record_aged_out_is_not_replaced(prefill: tuple[WireRules, MooncakeKVManager],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    rules, mgr = prefill
    monkeypatch.setattr(wire_rules, "MAX_KEYS", 2)
    assert deliver(rules, mgr, registration(), None) is None
    for i in range(3):
        assert deliver(rules, mgr, registration(key=f"10.0.0.{i + 10}:15001", ip=f"10.0.0.{i + 10}"), None) is None
    assert len(rules._registrants) == 2 and sum(rules._endpoints.values()) == 2
    assert "aged out" in (deliver(rules, mgr, registration(ptr=0xDEAD0000), None) or "")
    assert victim_ptr(mgr) == 0xAAAA0000


# ---------------------------------------------------------------------------------------------- transfer info

def test_transfer_info_needs_its_peers_registration(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, mgr = prefill
    assert rules.problem(transfer_info(), None) == "transfer_info: for an unregistered peer"
    assert rules.problem(transfer_info(dummy=True), None) is None  # a dummy rank carries no destination
    assert deliver(rules, mgr, registration(), S1) is None
    assert rules.problem(transfer_info(), S2) == "transfer_info: for a peer this sender did not register"
    assert rules.problem(transfer_info(), None) == "transfer_info: unsigned, for a peer that registered signed"
    assert rules.problem(transfer_info(ip="10.6.6.6"), S1) == \
        "transfer_info: a reply address other than the one its peer registered from"
    assert deliver(rules, mgr, transfer_info(), S1) is None


def test_no_second_destination_for_a_room(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    """The copy attack: the attacker's own registration plus a transfer info for the victim's room."""
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), None) is None
    assert deliver(rules, mgr, transfer_info(), None) is None
    assert deliver(rules, mgr, registration(key=OTHER, ip="10.6.6.6"), None) is None
    copy_same = transfer_info(key=OTHER, ip="10.6.6.6")
    copy_more = transfer_info(key=OTHER, ip="10.6.6.6", required=2)
    assert deliver(rules, mgr, copy_same, None) == "transfer_info: more destinations than the room's " \
                                                   "required_dst_info_num"
    assert deliver(rules, mgr, copy_more, None) == "transfer_info: the room's transfer infos disagree on " \
                                                   "required_dst_info_num"
    assert set(mgr.transfer_infos[1]) == {VICTIM}
    assert deliver(rules, mgr, transfer_info(room=2, key=OTHER, ip="10.6.6.6"), None) is None, "its own room"


def test_a_room_takes_as_many_destinations_as_it_requires(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, mgr = prefill  # decode TP 2, prefill TP 1: two decode ranks send for the same room
    for key, ip, sender in ((VICTIM, DECODE[0], S1), ("10.0.0.6:15001", "10.0.0.6", S2)):
        assert deliver(rules, mgr, registration(key=key, ip=ip), sender) is None
        assert deliver(rules, mgr, transfer_info(key=key, ip=ip, required=2), sender) is None
    assert len(mgr.transfer_infos[1]) == 2


# ------------------------------------------------------------------------------------------------------ abort

def test_abort_replies_only_to_decode_endpoints(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), S1) is None
    reflect = [b"ABORT", b"1", b"203.0.113.9", b"9999", b"1"]
    assert rules.problem(reflect, None) == \
        "abort: the reply address is no decode endpoint of the room nor of a registered peer"
    assert rules.problem([b"ABORT", b"1", b"10.0.0.5", b"40001", b"1"], S1) is None, "before the transfer info"
    assert rules.problem([b"ABORT", b"1", b"10.0.0.5", b"40001", b"1"], S2) is not None, "S2 registered nothing"
    assert deliver(rules, mgr, transfer_info(), S1) is None
    assert rules.problem([b"ABORT", b"1", b"10.0.0.5", b"40001"], S1) is None
    assert rules.problem([b"ABORT", b"1", b"10.0.0.5", b"40001"], S2) == \
        "abort: signed by none of the room's decode peers"
    # Mooncake before 0.5.22 reads the reply address inline; later releases take an abort without one
    assert rules.problem([b"ABORT", b"1"], None) == "abort: 2 frames, expected 4..5"
    mgr.__class__ = type("MooncakeKVManager", (MooncakeKVManager,), {"_handle_abort_notification": None,
                                                                      "__module__": MooncakeKVManager.__module__})
    rules = WireRules("mooncake", "prefill", mgr)
    assert rules.problem([b"ABORT", b"1"], None) is None  # no reply address: nothing is sent anywhere

def test_a_late_abort_is_answered_at_the_rooms_decode(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, mgr = prefill
    assert deliver(rules, mgr, registration(), None) is None
    assert deliver(rules, mgr, transfer_info(), None) is None
    mgr.transfer_infos.pop(1)  # the room concluded
    assert rules.problem([b"ABORT", b"1", b"10.0.0.5", b"40001", b"2"], None) is None
    assert rules.problem([b"ABORT", b"1", b"10.0.0.6", b"40001", b"2"], None) is not None


# ------------------------------------------------------------------------------------------------------ decode

def test_statuses_only_for_rooms_decode_knows_and_acks_by_shape(decode: tuple[WireRules, MooncakeKVManager]) -> None:
    """A status needs a live room. An ack is judged by its shape only: SGLang records one only for a room it holds,
    and the lifecycle's drain-ack ledger judges the rest, among them rooms SGLang already gave up on whose pages
    the guard keeps in quarantine for exactly that ack (a room rule here held such pages for good)."""
    rules, mgr = decode
    assert rules.problem([b"1", b"4", b"0"], None) is None
    assert rules.problem([b"9", b"4", b"0"], None) == "status: for a room this decode does not know"
    assert rules.problem([b"ABORT_ACK", b"1", b"0", b"1"], None) is None
    assert rules.problem([b"ABORT_ACK", b"9", b"0", b"1"], None) is None  # SGLang cleared and released room 9
    assert rules.problem([b"ABORT_ACK", b"x", b"0", b"1"], None) is not None, "an ack still needs its shape"
    del mgr._deferred_abort_ack_tracker  # 0.5.18: no table of held rooms
    assert rules.problem([b"ABORT_ACK", b"8", b"0"], None) is None


def test_aux_data_stays_inside_its_buffer(decode: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, _ = decode

    def aux(room: int, buffer: int, index: int, data: bytes) -> list[bytes]:
        return [b"AUX_DATA", str(room).encode(), str(buffer).encode(), str(index).encode(),
                struct.pack(">I", len(data)), data]

    assert rules.problem(aux(1, 0, 63, b"A" * 8), None) is None
    assert rules.problem(aux(1, 1, 31, b"A" * 4), None) is None
    assert rules.problem(aux(1, 0, 64, b"A" * 8), None) == "aux_data: the write would end past the buffer"
    assert rules.problem(aux(1, 0, 1 << 40, b"A" * 8), None) == "aux_data: the write would end past the buffer"
    assert rules.problem(aux(1, 2, 0, b"A"), None) == "aux_data: no such aux buffer"
    assert rules.problem(aux(1, 1, 0, b"A" * 8), None) == "aux_data: longer than the buffer's item"
    assert rules.problem(aux(9, 0, 0, b"A" * 8), None) == "aux_data: for a room this decode does not know"
    lying = aux(1, 0, 0, b"A" * 8)
    lying[4] = struct.pack(">I", 4)
    assert rules.problem(lying, None) == "aux_data: length frame disagrees with the data"


def test_staging_messages_need_staging(decode: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, _ = decode
    assert rules.problem([b"STAGING_REQ", b"1", b"0", b"4", VICTIM.encode(), b"0"], None) == \
        "staging_req: staging is off here"
    assert rules.problem([b"CHUNK_READY", b"1", b"0", b"0", b"4", b"w", b"0"], None) == \
        "chunk_ready: staging is off here"


def test_prefill_messages_are_unknown_to_decode(decode: tuple[WireRules, MooncakeKVManager]) -> None:
    rules, _ = decode
    assert rules.problem(registration(), None) == "unknown message type"
    assert rules.problem([b"ABORT", b"1"], None) == "unknown message type"
    assert rules.kind([b"ABORT", b"1"]) == "unknown"


def test_a_release_without_a_parser_drops_the_type() -> None:
    class Bare:  # a manager whose module carries no parsers (a release the rules do not know)
        request_status: dict[int, int] = {}

    Bare.__module__ = "builtins"

    rules = WireRules("mooncake", "prefill", Bare())
    assert rules.problem(transfer_info(), None) == "transfer_info: this release has no parser for it"


def test_staging_replies_are_bounded(prefill: tuple[WireRules, MooncakeKVManager]) -> None:
    """Mooncake's prefill appends to three lists up to a STAGING_RSP's chunk index, one item at a time (a chunk
    index of 10^9 is gigabytes and minutes on the listener thread; Mooncake reads it even with staging off)."""
    rules, mgr = prefill

    def reply(chunk: int, session: str = VICTIM) -> list[bytes]:
        return [b"STAGING_RSP", b"1", str(chunk).encode(), b"0", b"1", b"4096", session.encode()]

    assert rules.problem(reply(3), None) == "staging_rsp: staging is off here"
    mgr.enable_staging, mgr._staging_ctx = True, object()  # type: ignore[attr-defined]
    assert rules.problem(reply(3), None) == "staging_rsp: for no destination of a known room"
    assert deliver(rules, mgr, registration(), None) is None
    assert deliver(rules, mgr, transfer_info(), None) is None
    assert rules.problem(reply(3), None) is None
    assert rules.problem(reply(2**16), None) is None
    assert rules.problem(reply(2**16 + 1), None) == "staging_rsp chunk: out of range"
    assert rules.problem(reply(10**9), None) == "staging_rsp chunk: out of range"
    assert rules.problem(reply(3, OTHER), None) == "staging_rsp: for no destination of a known room"
