"""Drain acks that cannot lie, on real SGLang classes in one process (no server): run under a pin venv.

Decode's receiver is the pin's own ``CommonKVReceiver`` (built without ``__init__``: its fields as ``__init__`` sets
them, the target ranks resolved by the pin's own ``CommonKVManager._resolve_rank_mapping``) and sends its abort
notice through the pin's own ``_send_abort_notification`` (0.5.22+: with the generation the pin's
``register_deferred_abort_room`` arms); prefill's acks carry the ranks the pin's ``_prefill_unique_rank`` gives each
prefill rank and reach the plugin's hook through the pin's own ``note_abort_ack`` (0.5.22+:
``handle_abort_ack_message`` on ``AbortAck`` frames). The layout: decode TP 1, prefill attention TP 2 and PP 2, so
one decode transfer is written by four prefill ranks.

Asserted: forged acks (for a room without a transfer, before the transfer or before its notice, from a rank it
does not target, the same rank again, a stale or guessed generation) leave the quarantined pages held; the four
real acks release them, also after SGLang's own release timeout cleared its tracker; a flood leaves the ack
table at one entry per live transfer.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import random
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any

import pytest
from packaging.version import Version

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_harden import events  # noqa: E402
from sglang_harden.compat import activate, lifecycle_v05  # noqa: E402
from sglang_harden.compat.hooks import is_in_place  # noqa: E402
from sglang_harden.compat.lifecycle_nodes import DecodeNode  # noqa: E402

POOL = 48
ROOM, OTHER_ROOM = 9301, 9302
PREFILL_TP, PREFILL_PP = 2, 2


@pytest.fixture(scope="module")
def sgl() -> SimpleNamespace:
    activate("integration-test")
    from sglang.srt.disaggregation import decode
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.mem_cache.allocator import token

    for hook in lifecycle_v05.HOOKS:
        if hook.target == f"{conn.__name__}.CommonKVManager.note_abort_ack":
            assert is_in_place(hook), hook.target
    return SimpleNamespace(conn=conn, decode=decode, token=token,
                           numbered="generation" in inspect.signature(conn.CommonKVManager.note_abort_ack).parameters)


class Pair:
    """One decode transfer into a real allocator, written by four prefill ranks, and what decode sent them."""

    def __init__(self, sgl: SimpleNamespace) -> None:
        self.sgl = sgl
        conn = sgl.conn
        self.allocator = sgl.token.TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
        self.node = DecodeNode.for_allocator(self.allocator, cap=POOL)
        lifecycle_v05.NODE = self.node
        self.mgr = conn.CommonKVManager.__new__(conn.CommonKVManager)
        self.mgr.enable_deferred_decode_kv_release = True
        self.mgr._deferred_abort_ack_tracker = {}
        self.mgr._deferred_abort_generation = 0
        self.mgr.local_ip, self.mgr.rank_port = "127.0.0.1", 7000
        self.mgr.record_failure = lambda *args: None
        self.receiver = self._receiver(ROOM)
        self.notices: list[list[bytes]] = []

    def _receiver(self, room: int) -> Any:
        conn = self.sgl.conn

        class Receiver(conn.CommonKVReceiver):  # the pin's class; 0.5.19 leaves two methods to the backend
            def poll(self) -> Any: ...
            def failure_exception(self) -> Any: ...

        info = _prefill_info(conn)
        decode_side = SimpleNamespace(is_mla_backend=False, is_hybrid_mla_backend=False, attn_tp_size=1,
                                      kv_args=SimpleNamespace(engine_rank=0), attn_cp_size=1, attn_cp_rank=0,
                                      enable_all_cp_ranks_for_transfer=False, pp_size=1, pp_rank=0)
        conn.CommonKVManager._resolve_rank_mapping(decode_side, info)
        receiver = Receiver.__new__(Receiver)
        receiver.kv_mgr, receiver.bootstrap_room, receiver.bootstrap_addr = self.mgr, room, "127.0.0.1:8998"
        receiver.abort_notified, receiver.init_time, receiver.conclude_state = False, None, None
        if self.sgl.numbered:
            receiver._abort_generation = None
        receiver.prefill_info = info
        for name in ("target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks"):
            setattr(receiver, name, getattr(info, name))
        receiver.bootstrap_infos = [{"rank_ip": f"10.0.0.{i}", "rank_port": 9000 + i}
                                    for i in range(PREFILL_TP * PREFILL_PP)]
        receiver._connect_to_bootstrap_server = lambda bootstrap_info: (
            SimpleNamespace(send_multipart=self.notices.append), _NoLock())
        return receiver

    def publish(self) -> Any:
        pages = self.allocator.alloc(8)
        lifecycle_v05._send_metadata(lambda self, kv_indices, *a, **k: None)(self.receiver, pages.numpy())
        return pages

    def quarantine(self, pages: Any) -> None:
        """The request is let go while its transfer may still write: its pages are quarantined and the guard's
        request for prefill's drain ack (the pin's abort notice) goes out."""
        self.allocator.free(pages)
        assert self.node.ledger.quarantined_count() == 8
        assert len(self.notices) == PREFILL_TP * PREFILL_PP, "one abort notice per prefill rank"

    def generation(self) -> int | None:
        """The generation the notice carried on the wire (0.5.22+), None where notices are not numbered."""
        return int(self.notices[0][4]) if self.sgl.numbered else None

    def ack(self, room: int, rank: int, generation: int | None = None) -> None:
        """Prefill rank ``rank``'s ack as the pin's decode listener hands it on."""
        if self.sgl.numbered:
            frames = self.sgl.conn.AbortAck(room, rank, generation).to_zmq()
            assert self.mgr.handle_abort_ack_message(frames)
        else:
            self.mgr.note_abort_ack(room, rank)

    def held(self) -> int:
        """Quarantined pages after a scheduler step (the step that releases drained writers)."""
        self.sgl.decode.DecodeTransferQueue.pop_transferred(SimpleNamespace(queue=[]))
        return self.node.ledger.quarantined_count()


class _NoLock:
    def __enter__(self) -> None: ...

    def __exit__(self, *exc: object) -> None: ...


def _prefill_info(conn: Any) -> Any:
    names = {field.name for field in dataclasses.fields(conn.PrefillServerInfo)}
    values = {"attn_tp_size": PREFILL_TP, "attn_cp_size": 1, "dp_size": 1, "pp_size": PREFILL_PP, "page_size": 1,
              "kv_cache_dtype": "auto", "follow_bootstrap_room": True}
    return conn.PrefillServerInfo(**{name: value for name, value in values.items() if name in names})


def _prefill_ranks(conn: Any) -> list[int]:
    """What each of the four prefill ranks names itself in its ack (the pin's own ``_prefill_unique_rank``)."""
    return [conn.CommonKVManager._prefill_unique_rank(SimpleNamespace(attn_tp_rank=tp, pp_size=PREFILL_PP,
                                                                      attn_cp_size=1, pp_rank=pp, attn_cp_rank=0))
            for tp in range(PREFILL_TP) for pp in range(PREFILL_PP)]


@pytest.fixture()
def pair(sgl: SimpleNamespace) -> Pair:
    yield Pair(sgl)
    lifecycle_v05.NODE = None


def test_the_abort_notice_arms_the_acks_first(sgl: SimpleNamespace) -> None:
    target = f"{sgl.conn.__name__}.CommonKVReceiver._send_abort_notification"
    assert [is_in_place(hook) for hook in lifecycle_v05.HOOKS if hook.target == target] == [True]


def test_the_ranks_a_transfer_expects_are_the_ones_its_prefill_ranks_name(sgl: SimpleNamespace, pair: Pair) -> None:
    from sglang_harden.compat.drain_ack import expected_ack_ranks

    assert expected_ack_ranks(pair.receiver) == frozenset(_prefill_ranks(sgl.conn)) == {0, 1, 2, 3}
    receiver = sgl.conn.CommonKVReceiver
    init = inspect.getsource(receiver.init)  # where the receiver learns its prefill's layout (0.5.19 .. 0.5.23)
    for name in ("self.prefill_info", "self.target_tp_ranks", "self.target_pp_ranks", "self.target_cp_ranks"):
        assert f"{name} = " in init, f"{name}: compat/drain_ack.py reads it"
    assert ("self._abort_generation = " in inspect.getsource(receiver._send_abort_notification)) is sgl.numbered


# abort notices carry a generation from SGLang 0.5.22 on: a stale one is a forgery there only
NUMBERED_NOTICES = Version(version("sglang")) >= Version("0.5.22")
FORGERIES = ("before_transfer", "before_notice", "other_room", "untargeted_rank", "duplicate_rank") + (
    ("stale_generation",) if NUMBERED_NOTICES else ())


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_ack_leaves_the_quarantined_pages_held(sgl: SimpleNamespace, pair: Pair, forgery: str) -> None:
    """Each forgery alone, four acks' worth (as many as the transfer needs), each counted as ignored (the
    duplicates: all but the first, which is rank 0's real ack); then the real acks release."""
    assert sgl.numbered is NUMBERED_NOTICES
    ranks = _prefill_ranks(sgl.conn)
    before = _ignored()
    if forgery == "before_transfer":
        for rank in ranks:
            pair.ack(ROOM, rank, 1)  # 1: the generation the first notice will carry (a counter from 0)
    pages = pair.publish()
    if forgery == "before_notice":
        for rank in ranks:
            pair.ack(ROOM, rank, 1)
    pair.quarantine(pages)
    generation = pair.generation()
    forged = {"other_room": [(OTHER_ROOM, rank, generation) for rank in ranks],
              "untargeted_rank": [(ROOM, rank, generation) for rank in (4, 5, 6, 7)],
              "duplicate_rank": [(ROOM, ranks[0], generation)] * 4,
              "stale_generation": [(ROOM, rank, (generation or 0) + step) for step in (-1, 1) for rank in ranks]}
    for ack in forged.get(forgery, []):
        pair.ack(*ack)
    assert pair.held() == 8, f"{forgery}: released pages prefill may still write"
    assert _ignored() - before == (3 if forgery == "duplicate_rank" else len(forged.get(forgery, ranks))), forgery
    for rank in ranks:
        pair.ack(ROOM, rank, generation)
    assert pair.held() == 0, "the real acks release"


def _ignored() -> int:
    """Acks counted as ignored so far (the lifecycle guard's reject and skip decisions)."""
    counts = events.snapshot()
    return counts.get("lifecycle:reject", 0) + counts.get("lifecycle:skip", 0)


def test_every_ignored_ack_is_counted(sgl: SimpleNamespace, pair: Pair) -> None:
    ranks = _prefill_ranks(sgl.conn)
    before = events.snapshot()
    for rank in ranks:
        pair.ack(ROOM, rank, 1)  # before the transfer: nothing of the room exists yet
    pages = pair.publish()
    for rank in ranks:
        pair.ack(ROOM, rank, 1)  # the transfer exists, its notice was not sent: prefill has nothing to ack
    pair.quarantine(pages)
    generation = pair.generation()
    for rank in ranks:
        pair.ack(OTHER_ROOM, rank, generation)  # a room without a transfer here
    for rank in (4, 5, 7, 1 << 20):
        pair.ack(ROOM, rank, generation)  # ranks the transfer does not target
    for _ in ranks:
        pair.ack(ROOM, ranks[0], generation)  # one rank, four times
    if sgl.numbered:
        for stale in (generation - 1, generation + 1):
            for rank in ranks:
                pair.ack(ROOM, rank, stale)  # an earlier arming of the room, a guessed next one
    assert pair.held() == 8, "no forged ack may release pages prefill may still write"
    after = events.snapshot()
    counted = {label: after.get(label, 0) - before.get(label, 0) for label in ("lifecycle:reject", "lifecycle:skip")}
    assert counted == {"lifecycle:reject": 16 + (8 if sgl.numbered else 0), "lifecycle:skip": 3}, counted
    for rank in ranks[1:]:
        pair.ack(ROOM, rank, generation)  # the other three real acks (ranks[0]'s counted once above)
    assert pair.held() == 0
    assert pair.allocator.available_size() == POOL


def test_the_real_acks_release_after_sglangs_own_timeout_cleared_its_tracker(sgl: SimpleNamespace,
                                                                             pair: Pair) -> None:
    pages = pair.publish()
    pair.quarantine(pages)
    generation = pair.generation()
    pair.mgr.clear_deferred_abort_state(ROOM)  # SGLang's deferred release timed out: its tracker forgot the room
    ranks = _prefill_ranks(sgl.conn)
    for rank in ranks[:-1]:
        pair.ack(ROOM, rank, generation)
    assert pair.held() == 8
    pair.ack(ROOM, ranks[-1], generation)
    assert pair.held() == 0


def _ack_table(node: DecodeNode) -> int:
    """Rooms decode's ack table holds (``_acks``, a dict per room, before it was bounded: the flood shows it grow)."""
    return len(node.acks) if hasattr(node, "acks") else len(node._acks)


def test_a_flood_of_forged_acks_leaves_one_entry_per_live_transfer(sgl: SimpleNamespace, pair: Pair) -> None:
    pages = pair.publish()
    pair.quarantine(pages)
    rng = random.Random(39)
    for _ in range(5000):
        pair.ack(rng.getrandbits(62), rng.getrandbits(8), rng.getrandbits(8))
    assert _ack_table(pair.node) <= 1, "forged acks of rooms without a transfer are kept"
    for rank in _prefill_ranks(sgl.conn):
        pair.ack(ROOM, rank, pair.generation())
    assert pair.held() == 0
    assert _ack_table(pair.node) == 0, "the entry goes with its transfer"


# Releases whose own waiting timeout sends decode's abort notice without arming SGLang's ack tracker (only
# Scheduler.abort_request arms it there): their deferred release ignores every ack and holds the room to its timeout.
UNARMED_TIMEOUT_NOTICE = Version(version("sglang")) < Version("0.5.21")


def _time_out(pair: Pair) -> None:
    """Decode's waiting timeout on a published transfer, through the pin's own ``_check_waiting_timeout``: it fails
    the room and sends the abort notice."""
    import threading
    import time

    from sglang.srt.disaggregation.base import KVPoll

    mgr, receiver = pair.mgr, pair.receiver
    mgr.request_status = {ROOM: KVPoll.WaitingForInput}
    mgr.waiting_timeout, mgr.deferred_bootstrap = 1, None
    mgr.connection_lock, mgr.connection_pool = threading.Lock(), {}
    receiver._connection_pool_entries = {}
    receiver.init_time = time.time() - 5  # send_metadata ran 5 s ago
    assert receiver._check_waiting_timeout() == KVPoll.Failed


def _release_safe(sgl: SimpleNamespace, pair: Pair) -> tuple[bool, bool]:
    """(the pin's own answer, the hooked one) to "may the held room go?", as its deferred release asks it."""
    hooked = sgl.conn.CommonKVManager.is_abort_release_safe
    own = inspect.unwrap(hooked)
    required = len(pair.receiver.bootstrap_infos)
    return bool(own(pair.mgr, ROOM, required)), bool(hooked(pair.mgr, ROOM, required))


def test_the_deferred_release_ends_on_the_drain_acks_of_a_timed_out_room(sgl: SimpleNamespace, pair: Pair) -> None:
    """Issue 40 (b): decode gives up on a room by its waiting timeout; prefill, which never started a write for it,
    acks the drain at once (every rank). On 0.5.19/0.5.20 SGLang's own check never counts those acks (the timeout's
    notice did not arm its tracker), so the room is held until the deferred-release timeout (30 s) and the next
    request waits for its pages; the hooked check lets it go on the acks, and not before every targeted rank's
    (forged acks: ``test_a_forged_ack_leaves_the_quarantined_pages_held``, which the same node's count decides)."""
    target = f"{sgl.conn.__name__}.CommonKVManager.is_abort_release_safe"
    assert any(is_in_place(hook) and hook.owner == "lifecycle" for hook in _lifecycle_hooks() if hook.target == target)
    pair.publish()
    _time_out(pair)
    assert pair.receiver.abort_notified and len(pair.notices) == PREFILL_TP * PREFILL_PP
    assert _release_safe(sgl, pair) == (False, False), "nothing acked yet: held"
    generation = pair.generation()
    ranks = _prefill_ranks(sgl.conn)
    for rank in ranks[:-1]:
        pair.ack(ROOM, rank, generation)
    assert _release_safe(sgl, pair) == (False, False), "a targeted rank has not acked: held"
    before = events.snapshot().get("lifecycle:release", 0)
    pair.ack(ROOM, ranks[-1], generation)
    own, hooked = _release_safe(sgl, pair)
    assert hooked, "every targeted rank acked the drain: the held room must go now"
    assert own is not UNARMED_TIMEOUT_NOTICE, "the pin's own check (the harm the hook removes on 0.5.19/0.5.20)"
    released = events.snapshot().get("lifecycle:release", 0) - before
    assert released == (1 if UNARMED_TIMEOUT_NOTICE else 0), "the guard's release is its own decision, once"


def test_a_room_prefill_never_started_is_released_without_acks(sgl: SimpleNamespace, pair: Pair) -> None:
    """Prefill said it never queued a write for the room (its handshake failed): no ack comes, none is needed."""
    pair.publish()
    _time_out(pair)
    assert _release_safe(sgl, pair)[1] is False
    pair.node.note_never_started(ROOM, pair.receiver.bootstrap_addr)
    assert _release_safe(sgl, pair)[1] is True


def _lifecycle_hooks() -> list[Any]:
    from sglang_harden.compat import sglang_v05

    return sglang_v05.LIFECYCLE_HOOKS
