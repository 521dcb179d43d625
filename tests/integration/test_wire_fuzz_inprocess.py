"""Fuzzing SGLang's real PD side-channel listeners behind the hardened receive: run under a pin venv (CI: 0.5.19,
0.5.23).

For every message type of every backend (Mooncake, NIXL, MORI with a stand-in ``mori`` package) and role,
Hypothesis draws messages (well formed with varied fields, or mutated: truncated, extra frames, wrong / huge /
non-ASCII ints, empty frames, random bytes), unsigned, signed by the victim decode (S1), by another holder of the
secret (S2) or with a wrong key, to a rank port that enforces authentication or only logs it. They go through a
real pyzmq socket of the verifying class (``Inbox``: auth frame checked and removed, then ``WireRules``) into the
pin's real listener closure (``wire_harness``), after a prelude the rules are about (the victim registered and sent
its transfer info for room 1). The same message also goes, unsigned and unchecked, to a vanilla listener of the
same pin. Asserted after each message:

- the hardened listener never raised (MORI: its loops never caught an exception), an AUX_DATA write stayed inside
  its buffer (guard bytes around each);
- unauthenticated input where authentication is enforced: nothing reached the listener, the manager's state is
  the very same objects as before, nothing was sent;
- prefill: every room's transfer infos agree on ``required_dst_info_num`` and number no more than it; the victim's
  registration is replaced only by S1; every ack prefill sent went to a decode endpoint (a transfer info's or a
  registration's); Mooncake's scheduler-thread ``add_transfer_request`` parses every destination of every room;
- decode: no status, ack or aux write created a room.

And per type: where the drawn messages of that type kill the vanilla listener on the pin (``_vanilla_dies``),
some of them did; a type the listener reads here had messages admitted (listener code exercised), a type it does
not read (staging, deferred allocation off) had none. Further vanilla cases below: ``[b"x"]`` ends Mooncake's and
NIXL's prefill threads, ``[b"AUX_DATA"]`` Mooncake's decode thread, a bad ABORT_ACK 0.5.19 NIXL's decode thread; a
Mooncake transfer info with session ``x`` raises in ``add_transfer_request``; a forged registration replaces a
victim's pointers; an AUX_DATA with a wild index makes SGLang's own codec segfault (in a subprocess).

``SGLANG_HARDEN_WIRE_FUZZ_EXAMPLES`` (default 1000) examples per message type; ``scripts/fuzz_side_channels.sh``
runs more.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang")
pytest.importorskip("hypothesis")
pytest.importorskip("zmq")

import wire_messages as m  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from wire_harness import ENDPOINT, ROOMS, Listener, ListenerDied, mori_conn, reset, same_state  # noqa: E402
from wire_strategies import DECODE_KINDS, PREFILL_KINDS, messages  # noqa: E402

from sglang_harden import events  # noqa: E402
from sglang_harden.compat import control_auth  # noqa: E402
from sglang_harden.compat.backends.wire_rules import WireRules  # noqa: E402
from sglang_harden.compat.backends.wire_shapes import MAX_CHUNKS  # noqa: E402
from sglang_harden.compat.runtime import RUNTIME  # noqa: E402
from sglang_harden.config import HardenConfig, Mode  # noqa: E402
from sglang_harden.guards.bootstrap_auth import MIN_SECRET_CHARS, parse_secrets  # noqa: E402
from sglang_harden.guards.zmq_auth import Signer  # noqa: E402

EXAMPLES = int(os.environ.get("SGLANG_HARDEN_WIRE_FUZZ_EXAMPLES", "1000"))
SECRET, WRONG_SECRET = "s" * MIN_SECRET_CHARS, "w" * MIN_SECRET_CHARS
S1, S2 = b"\x01" * 16, b"\x02" * 16
SIGNERS = {"S1": Signer(S1), "S2": Signer(S2), "forged": Signer(S1)}
VICTIM_PTR = 0xAAAA0000
BACKENDS = ("mooncake", "nixl", "mori")
CASES = [(b, "prefill", k) for b in BACKENDS for k in PREFILL_KINDS] + [
    (b, "decode", k) for b in BACKENDS for k in DECODE_KINDS]
# AUX_DATA is not fed to a vanilla listener: a wild index writes anywhere in this process (shown in a subprocess)
NOT_FED_TO_VANILLA = {"aux_data"}
DECIMAL = re.compile(rb"-?[0-9]{1,30}")


def _pin() -> tuple[int, ...]:
    import sglang

    return tuple(int(x) for x in sglang.__version__.split(".")[:3])


@pytest.fixture(scope="module")
def conns() -> Iterator[dict[str, Any]]:
    from sglang.srt.disaggregation.mooncake import conn as mooncake
    from sglang.srt.disaggregation.nixl import conn as nixl

    # thousands of vanilla listener deaths and refused messages: their tracebacks and warnings would be most of the
    # run's time and output (MORI's caught exceptions are still seen: wire_harness intercepts logger.exception)
    quiet = [logging.getLogger(name) for name in ("sglang.srt.disaggregation", "sglang_harden")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.CRITICAL)
    try:
        yield {"mooncake": mooncake, "nixl": nixl, "mori": mori_conn()}
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[bool, HardenConfig]]:
    """The deployment's secret configured; the rank port enforcing authentication (True) or logging it."""
    secret = tmp_path_factory.mktemp("wire") / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    saved = RUNTIME.config
    base = HardenConfig(bootstrap_secret_file=str(secret))
    configs = {True: dataclasses.replace(base, zmq_auth=Mode.ENFORCE),
               False: dataclasses.replace(base, zmq_auth=Mode.LOG)}
    control_auth._cache.clear()
    RUNTIME.config = configs[True]
    try:
        yield configs
    finally:
        RUNTIME.config = saved
        control_auth._cache.clear()
        events.reset_for_tests()


@pytest.fixture(scope="module")
def listeners(conns: dict[str, Any]) -> Iterator[dict[tuple[str, str, bool], Listener]]:
    made: dict[tuple[str, str, bool], Listener] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, key: tuple[str, str, bool]) -> Listener:
            self[key] = made[key] = _listener(conns, *key)
            return self[key]

    yield Lazy()
    for listener in made.values():
        listener.close()


def _listener(conns: dict[str, Any], backend: str, role: str, verifying: bool = False) -> Listener:
    listener = Listener(backend, role, conns[backend], _pin(), verifying=verifying)
    if backend == "mooncake":  # reads the scheduler's global config (not published here); the rules call it too
        listener.manager._validate_peer_state_layout = lambda info: (True, None)
    return listener


def _signed(frames: list[bytes], signer: str) -> list[bytes]:
    if signer == "unsigned":
        return frames
    key = parse_secrets(WRONG_SECRET if signer == "forged" else SECRET)
    return [*frames, SIGNERS[signer].sign(key, frames, ENDPOINT)]


# ------------------------------------------------------------------------------------------------ fuzzing


@pytest.mark.parametrize(("backend", "role", "kind"), CASES, ids=["-".join(c) for c in CASES])
def test_hardened_listener_survives_and_vanilla_does_not(listeners: dict[tuple[str, str, bool], Listener],
                                                         secured: dict[bool, HardenConfig], backend: str,
                                                         role: str, kind: str) -> None:
    hardened, vanilla = listeners[(backend, role, True)], listeners[(backend, role, False)]
    seen = {"admitted": 0, "dropped": 0, "vanilla_died": 0, "admitted_as_" + kind: 0}
    RUNTIME.config = secured[False]  # the prelude's unsigned registration is served (and counted)
    prelude = _prelude(hardened)
    vanilla_state = _prelude(vanilla)
    inbox = hardened.socket._sgh_inbox
    first_death: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(message=messages(backend, kind))
    def one(message: tuple[list[bytes], str, bool]) -> None:
        frames, signer, enforce = message
        RUNTIME.config = secured[enforce]
        inbox.rules = prelude()
        unauthenticated = enforce and signer in ("unsigned", "forged")
        before = hardened.snapshot() if unauthenticated else {}
        admitted = hardened.socket._sgh_admitted
        hardened.feed(_signed(frames, signer))  # raises ListenerDied if the listener raised
        got = hardened.socket._sgh_admitted - admitted
        seen["admitted" if got else "dropped"] += 1
        if got:  # a mutation may have made it another type (a new head frame)
            as_kind = "admitted_as_" + inbox.rules.kind(frames)
            seen[as_kind] = seen.get(as_kind, 0) + 1
        if unauthenticated:
            assert not got and not hardened.sent, "unauthenticated input reached the listener"
            assert same_state(before, hardened.snapshot()), "unauthenticated input changed the manager's state"
        (_prefill_invariants if role == "prefill" else _decode_invariants)(hardened, signer)
        if kind not in NOT_FED_TO_VANILLA and _bounded_in_vanilla(frames, seen):
            vanilla_state()
            try:
                vanilla.feed(frames)
            except ListenerDied as exc:
                seen["vanilla_died"] += 1
                first_death[:] = first_death or [str(exc)]

    one()
    print(f"{backend} {role} {kind}: {seen} {first_death[:1]}")
    assert seen["admitted"] + seen["dropped"] >= EXAMPLES, ("Hypothesis ran fewer cases than asked", seen)
    if _read_here(backend, role, kind):
        assert seen["admitted_as_" + kind], "nothing of this type was admitted: no listener code was exercised"
    else:
        assert not seen["admitted_as_" + kind], "a type this listener does not read here was admitted"
    if _vanilla_dies(backend, role, kind):
        assert seen["vanilla_died"], "the vanilla listener survived every message of this type"


def _bounded_in_vanilla(frames: list[bytes], seen: dict[str, int]) -> bool:
    """False for a STAGING_RSP whose chunk index would make a vanilla listener append to three lists up to it, one
    item at a time (Mooncake handles it even with staging off: gigabytes and minutes from one message; counted)."""
    if len(frames) > 2 and frames[0] == b"STAGING_RSP" and DECIMAL.fullmatch(frames[2]) and \
            int(frames[2]) > MAX_CHUNKS:
        seen["vanilla_unbounded"] = seen.get("vanilla_unbounded", 0) + 1
        return False
    return True


def _vanilla_dies(backend: str, role: str, kind: str) -> bool:
    """Where a fair share of the drawn messages of a type kill the vanilla listener thread (a third or more, seen
    on the CI pins; MORI's loops catch everything, and what they catch is counted, not required)."""
    if role == "prefill" and backend in ("mooncake", "nixl"):
        return kind in ("registration", "transfer_info", "bootstrap", "unknown")
    if role == "decode" and backend == "mooncake":  # up to 0.5.19 the status is unpacked as exactly three frames
        return kind == "staging_req" or (_pin() < (0, 5, 20) and kind in ("status", "unknown"))
    return False


def _read_here(backend: str, role: str, kind: str) -> bool:
    """Whether the harness's listener reads the type at all (staging and deferred allocation are off here)."""
    if kind in ("watermark", "staging_rsp", "bootstrap", "staging_req", "chunk_ready", "unknown"):
        return False
    if role == "prefill":
        return True
    if kind == "status":
        return backend != "nixl" or _pin() >= (0, 5, 20)  # NIXL reports statuses over this socket from 0.5.20
    if kind == "abort_ack":
        return backend != "mori" or _pin() >= (0, 5, 22)  # MORI has drain acks from 0.5.22
    return backend != "nixl"  # aux_data: NIXL sends aux over NIXL


def _prelude(listener: Listener) -> Callable[[], WireRules]:
    """Fresh state for each example: on prefill, the victim decode (S1) registered and sent its transfer info for
    room 1, and another decode registered unsigned (through the listener once; later the manager's state and the
    rules' record are restored)."""
    reset(listener)
    template = WireRules(listener.backend, listener.role, listener.manager)
    if listener.push is not None:
        listener.guard(template)
    if listener.role == "prefill":
        backend = listener.backend
        other = m.registration(backend, key=m.OTHER_KEYS[backend], ip=m.OTHER_IP, port=m.OTHER_PORT, kv_ptr=0xCAFE0000)
        for message, signer in ((m.registration(backend, kv_ptr=VICTIM_PTR), "S1"),
                                (m.transfer_info(backend, 1), "S1"), (other, "unsigned")):
            admitted = listener.socket._sgh_admitted if listener.push is not None else 0
            listener.feed(_signed(message, signer) if listener.push is not None else message)
            assert listener.push is None or listener.socket._sgh_admitted > admitted, "the prelude was refused"
        listener.victim = listener.manager.decode_kv_args_table[m.KEYS[listener.backend]]
    state = listener.snapshot()

    def fresh() -> WireRules:
        listener.restore(state)
        return _clone(template)

    return fresh


def _clone(rules: WireRules) -> WireRules:
    """A copy of the rules' record after the prelude (deepcopy would cost a millisecond an example)."""
    twin = copy.copy(rules)
    twin._registrants = OrderedDict(rules._registrants)  # records are replaced, never changed in place
    twin._endpoints, twin._sender_endpoints = Counter(rules._endpoints), Counter(rules._sender_endpoints)
    twin._rooms = OrderedDict((room, dataclasses.replace(record, endpoints=set(record.endpoints),
                                                         senders=set(record.senders)))
                              for room, record in rules._rooms.items())
    return twin


def _prefill_invariants(listener: Listener, signer: str) -> None:
    mgr = listener.manager
    endpoints = {(m.DECODE_IP, m.DECODE_PORT)} | set(listener.socket._sgh_inbox.rules._endpoints)
    for room, infos in mgr.transfer_infos.items():
        required = {info.required_dst_info_num for info in infos.values()}
        assert len(required) <= 1, f"room {room}: transfer infos disagree on required_dst_info_num"
        assert not required or len(infos) <= required.pop(), f"room {room}: more destinations than required"
        endpoints |= {(info.endpoint, info.dst_port) for info in infos.values()}
    victim = mgr.decode_kv_args_table.get(m.KEYS[listener.backend])
    if signer != "S1" and victim is not listener.victim:
        assert getattr(victim, "dst_kv_ptrs", None) == listener.victim.dst_kv_ptrs, "victim's registration replaced"
    allowed = {_tcp(listener, ip, port) for ip, port in endpoints}
    assert {endpoint for endpoint, _ in listener.sent} <= allowed, "an ack went to an address of no decode"
    if listener.backend == "mooncake":
        for room in list(mgr.transfer_infos):
            mgr.request_status.setdefault(room, listener.conn.KVPoll.WaitingForInput)
            mgr.add_transfer_request(room, np.arange(1, dtype=np.int32), slice(0, 1), False)


def _decode_invariants(listener: Listener, signer: str) -> None:
    assert set(listener.manager.request_status) == set(ROOMS), "a status created a room"


def _tcp(listener: Listener, ip: str, port: int) -> str:
    try:
        return listener.conn.NetworkAddress(ip, port).to_tcp()
    except Exception:  # noqa: BLE001 - SGLang cannot send there either
        return f"tcp://{ip}:{port}"


# ------------------------------------------------------------------------------------- without WireRules


@pytest.fixture()
def vanilla(conns: dict[str, Any]) -> list[Listener]:
    return []


def _fresh(conns: dict[str, Any], made: list[Listener], backend: str, role: str) -> Listener:
    listener = _listener(conns, backend, role)
    made.append(listener)
    return listener


# (backend, role, frames, the first release that no longer dies on them)
KILLS = [
    ("mooncake", "prefill", [b"x"], None),
    ("mooncake", "prefill", [b"ABORT"], (0, 5, 22)),
    ("nixl", "prefill", [b"x"], None),
    ("mooncake", "decode", [b"AUX_DATA"], None),
    ("nixl", "decode", [b"ABORT_ACK", b"x", b"y"], (0, 5, 22)),
    ("mori", "prefill", [m.MORI_GUARD, b"x"], None),  # MORI's loops catch it (the harness sees the catch)
    ("mori", "decode", [b"AUX_DATA"], None),
]


@pytest.mark.parametrize(("backend", "role", "frames", "fixed_in"), KILLS,
                         ids=[f"{b}-{r}-{f[-1]!r}" for b, r, f, _ in KILLS])
def test_vanilla_listener_raises_and_the_rules_drop_it(conns: dict[str, Any], vanilla: list[Listener], backend: str,
                                                       role: str, frames: list[bytes],
                                                       fixed_in: tuple[int, ...] | None) -> None:
    listener = _fresh(conns, vanilla, backend, role)
    assert WireRules(backend, role, listener.manager).problem(frames, None) is not None
    if fixed_in is not None and _pin() >= fixed_in:
        listener.feed(frames)
        assert listener.alive()
        return
    with pytest.raises(ListenerDied):
        listener.feed(frames)


def test_vanilla_mooncake_session_without_port_crashes_the_scheduler(conns: dict[str, Any],
                                                                      vanilla: list[Listener]) -> None:
    listener = _fresh(conns, vanilla, "mooncake", "prefill")
    forged = [b"1", b"10.6.6.6", b"6666", b"x", b"", b"", b"", b"1"]
    listener.feed(forged)  # the listener takes it...
    with pytest.raises(IndexError):  # ...and the scheduler thread's next chunk of room 1 dies on it
        listener.manager.add_transfer_request(1, np.arange(1, dtype=np.int32), slice(0, 1), False)
    assert WireRules("mooncake", "prefill", listener.manager).problem(forged, None) is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_vanilla_forgeries_and_the_rules(conns: dict[str, Any], vanilla: list[Listener], backend: str) -> None:
    """A replaced registration (Mooncake) and a second destination for the victim's room (all backends)."""
    listener = _fresh(conns, vanilla, backend, "prefill")
    victim_reg = m.registration(backend, kv_ptr=VICTIM_PTR)
    victim_info = m.transfer_info(backend, 1)
    forged_reg = m.registration(backend, kv_ptr=0xDEAD0000, ip="10.6.6.6")
    attacker_reg = m.registration(backend, key=m.OTHER_KEYS[backend], ip="10.6.6.6")
    copy = m.transfer_info(backend, 1, key=m.OTHER_KEYS[backend], required=2, ip="10.6.6.6")
    mgr = listener.manager
    if backend == "mori":  # MORI takes transfer infos only before the room bootstrapped: the attacker comes first
        sequence = [(victim_reg, S1), (attacker_reg, S2), (copy, S2), (victim_info, S1), (forged_reg, S2)]
    else:
        sequence = [(victim_reg, S1), (victim_info, S1), (forged_reg, S2), (attacker_reg, S2), (copy, S2)]
    for frames, _ in sequence:
        listener.feed(frames)
    victim_ptrs = getattr(mgr.decode_kv_args_table[m.KEYS[backend]], "dst_kv_ptrs", [VICTIM_PTR])
    assert (victim_ptrs[0] != VICTIM_PTR) == (backend == "mooncake"), "vanilla: Mooncake replaces the victim"
    assert set(mgr.transfer_infos[1]) == {m.KEYS[backend], m.OTHER_KEYS[backend]}, "vanilla: a second destination"

    for signed in (True, False):  # authenticated senders, and unsigned (no secret: the first registration wins)
        reset(listener)
        rules = WireRules(backend, "prefill", mgr)
        for frames, sender in sequence:
            if rules.problem(frames, sender if signed else None) is None:
                listener.feed(frames)
        victim_ptrs = getattr(mgr.decode_kv_args_table[m.KEYS[backend]], "dst_kv_ptrs", [VICTIM_PTR])
        assert victim_ptrs[0] == VICTIM_PTR, "hardened: the victim's registration stays"
        if signed or backend != "mori":  # unsigned MORI: the attacker came first, the victim's info is the odd one
            assert set(mgr.transfer_infos.get(1, {})) != {m.KEYS[backend], m.OTHER_KEYS[backend]}, "no copy"


def test_wild_aux_index_segfaults_sglangs_codec_and_the_rules_drop_it(conns: dict[str, Any],
                                                                      vanilla: list[Listener],
                                                                      tmp_path: Path) -> None:
    from sglang.srt.disaggregation.common.utils import AuxDataCodec

    source = textwrap.dedent(inspect.getsource(AuxDataCodec.deserialize_data_to_buffer)).replace("@staticmethod\n", "")
    child = ("import ctypes, types\n" + source + "\nbuf = ctypes.create_string_buffer(64)\n"
             "args = types.SimpleNamespace(aux_data_ptrs=[ctypes.addressof(buf)], aux_item_lens=[8])\n"
             "deserialize_data_to_buffer(args, 0, 1 << 40, b'A' * 8)\n")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=60, check=False, cwd=tmp_path)
    assert done.returncode == -11, (done.returncode, done.stderr[-500:])  # SIGSEGV: SGLang's own write, unchecked
    for backend in ("mooncake", "mori"):
        listener = _fresh(conns, vanilla, backend, "decode")
        wild = m.aux_data(ROOMS[0], 0, 1 << 40, b"A" * 8)
        assert WireRules(backend, "decode", listener.manager).problem(wild, None) == \
            "aux_data: the write would end past the buffer"
