"""The 0.4.9.post6 adapter's wrappers on plain fakes (no SGLang): what each applies, and when it passes through.

SGLang functions the wrappers import at call time (``prepare_abort``, ``KVPoll``) are stand-ins in
``sys.modules`` for the duration of each test.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from sglang_harden.compat import notify
from sglang_harden.compat import sglang_v049 as v049
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.guards.coverage import encode_coverage


class FINISH_ABORT:  # noqa: N801 - SGLang's class name is what the adapter recognises
    def __init__(self, message: str, status_code: int | None = None) -> None:
        self.message, self.status_code = message, status_code


@dataclass
class Req:
    rid: str
    origin_input_ids: list[int]
    bootstrap_room: int = 7
    bootstrap_host: str = "127.0.0.1"
    finished_reason: Any = None
    to_abort: bool = False
    return_logprob: bool = False
    start_send_idx: int = 0
    metadata_buffer_index: int = 0
    disagg_kv_sender: Any = None


@dataclass
class Scheduler:
    max_req_input_len: int = 250
    streamed: list[Any] = field(default_factory=list)

    def stream_output(self, reqs: list[Any], return_logprob: bool, skip_req: Any = None) -> None:
        self.streamed.extend(reqs)


def _prepare_abort(req: Any, error_message: str, status_code: Any = None) -> None:
    req.finished_reason = FINISH_ABORT(error_message, status_code)


@pytest.fixture(autouse=True)
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    utils = types.ModuleType("sglang.srt.disaggregation.utils")
    utils.prepare_abort = _prepare_abort  # type: ignore[attr-defined]
    decode = types.ModuleType("sglang.srt.disaggregation.decode")
    decode.prepare_abort = _prepare_abort  # type: ignore[attr-defined]
    disagg = types.ModuleType("sglang.srt.disaggregation")
    disagg.decode = decode  # type: ignore[attr-defined]
    for name, mod in {"sglang.srt.disaggregation": disagg, "sglang.srt.disaggregation.utils": utils,
                      "sglang.srt.disaggregation.decode": decode}.items():
        monkeypatch.setitem(sys.modules, name, mod)


class Publisher:
    def __init__(self) -> None:
        self.aborts: list[notify.PeerAbort] = []

    def publish(self, abort: notify.PeerAbort) -> None:
        self.aborts.append(abort)


@pytest.fixture
def publisher(monkeypatch: pytest.MonkeyPatch) -> Publisher:
    pub = Publisher()
    monkeypatch.setattr(RUNTIME, "publisher", pub)
    return pub


def _recording(calls: list[Any], result: Any = "original") -> Any:
    def original(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return result

    return original


def test_prefill_door_retires_the_stub_with_its_original_error(publisher: Publisher) -> None:
    scheduler, calls = Scheduler(), []
    queue = types.SimpleNamespace(scheduler=scheduler)
    msg = "Input length (300 tokens) exceeds the maximum allowed length (250 tokens)."
    req = Req("B", [0], finished_reason=FINISH_ABORT(msg, 400))
    assert v049._door("prefill")(_recording(calls))(queue, req, 2) is None
    assert calls == [] and scheduler.streamed == [req]
    assert (req.finished_reason.message, req.finished_reason.status_code) == (msg, 400)
    assert publisher.aborts == [notify.PeerAbort(7, 400, msg, sent_kv=False)]


def test_decode_door_rejects_over_limit_and_passes_retracted_and_fitting(publisher: Publisher) -> None:
    scheduler, calls = Scheduler(max_req_input_len=100), []
    door = v049._door("decode")(_recording(calls))
    queue = types.SimpleNamespace(scheduler=scheduler)
    assert door(queue, Req("long", [1] * 101)) is None and scheduler.streamed[0].rid == "long"
    assert scheduler.streamed[0].finished_reason.status_code == 400
    door(queue, Req("retracted", [1] * 101), True)
    door(queue, Req("fits", [1] * 100))  # what auto-truncate produces: exactly max_req_input_len tokens
    assert [c[1].rid for c in calls] == ["retracted", "fits"]
    assert publisher.aborts == []  # decode does not publish to prefill


def test_retire_skips_final_send_of_aborted_request_and_fails_its_sender(publisher: Publisher) -> None:
    calls: list[Any] = []
    sender = types.SimpleNamespace(aborted=False)
    sender.abort = lambda: setattr(sender, "aborted", True)
    send = v049._retire_final_send(_recording(calls))
    req = Req("r", [1] * 10, to_abort=True, disagg_kv_sender=sender)
    assert send(object(), req, True) is None and sender.aborted and calls == []
    assert publisher.aborts and publisher.aborts[0].room == 7
    assert publisher.aborts[0].sent_kv, "earlier chunks may have gone out: decode must not free on our word"
    send(object(), req, False)  # non-final chunks pass
    send(object(), Req("ok", [1] * 10), True)
    assert len(calls) == 2


@pytest.mark.parametrize(("retired", "published"), [(True, 1), (False, 0)])
def test_upstream_retirement_of_an_aborted_result_is_published(
    publisher: Publisher, retired: bool, published: int
) -> None:
    """0.5.20+ retires an aborted prefill result itself; once it did (True), decode is told, with the message."""
    from sglang_harden.compat import shared

    wrapped = shared.publish_retired_abort(v049.READER)(_recording([], result=retired))
    req = Req("r", [1] * 10, finished_reason=FINISH_ABORT("client went away", 499))
    assert wrapped(object(), req) is retired
    assert len(publisher.aborts) == published
    if published:
        abort = publisher.aborts[0]
        assert (abort.room, abort.status_code, abort.sent_kv) == (7, 499, True)
        assert "client went away" in abort.message


class Buffers:
    def __init__(self) -> None:
        self.output_ids = [[0] * 16 for _ in range(4)]


def _queue_with(entries: list[tuple[Req, int]]) -> Any:
    scheduler = Scheduler()
    freed: list[Any] = []
    tree = types.SimpleNamespace(cache_finished_req=freed.append)
    queue = types.SimpleNamespace(
        queue=[types.SimpleNamespace(req=r, metadata_buffer_index=i) for r, i in entries],
        metadata_buffers=Buffers(), scheduler=scheduler, tree_cache=tree, freed=freed,
    )
    return queue


def test_prefill_publishes_tokens_sent_bound_to_the_room() -> None:
    buf, req = Buffers(), Req("r", [1] * 300, bootstrap_room=99, start_send_idx=300, metadata_buffer_index=2)
    v049._publish_coverage(lambda self, r: None)(buf, req)
    assert buf.output_ids[2][v049.COVERAGE_SLOT] == encode_coverage(300, 99)
    assert buf.output_ids[2][0] == 0  # the first output token's slot is SGLang's


def test_decode_commits_only_fully_covered_transfers() -> None:
    full, short, stale, fake = (Req("full", [1] * 300, 1), Req("short", [1] * 300, 2),
                                Req("stale", [1] * 300, 3), Req("warmup", [1] * 4, 4, bootstrap_host="2.2.2.2"))
    queue = _queue_with([(full, 0), (short, 1), (stale, 2), (fake, 3)])
    rows = queue.metadata_buffers.output_ids
    rows[0][15], rows[1][15], rows[2][15] = encode_coverage(300, 1), encode_coverage(1, 2), encode_coverage(300, 9)
    pop = v049._check_coverage(lambda self: [full, short, stale, fake])
    assert pop(queue) == [full, fake]
    assert queue.scheduler.streamed == [short, stale] and queue.freed == [short, stale]
    assert "sent KV for 1 tokens" in short.finished_reason.message
    assert "did not publish" in stale.finished_reason.message


def test_peer_abort_keeps_prefills_status_and_message(monkeypatch: pytest.MonkeyPatch) -> None:
    hit = notify.PeerAbort(5, 400, "Input length (300 tokens) exceeds ...")
    monkeypatch.setattr(RUNTIME, "watcher", types.SimpleNamespace(hit=lambda room: hit if room == 5 else None))
    seen: list[Any] = []
    wrapped = v049.peer_status_abort(lambda req, msg, status_code=None: seen.append((msg, status_code)))
    wrapped(Req("b", [1], bootstrap_room=5), "Decode transfer failed", status_code=500)
    wrapped(Req("c", [1], bootstrap_room=6), "Decode transfer failed", status_code=500)
    assert seen == [(hit.message, 400), ("Decode transfer failed", 500)]


def test_decode_refuses_a_backend_without_the_abort_side_channel() -> None:
    with pytest.raises(HardenRefusal, match="abort notification supports the mooncake"):
        v049._verify_in_process("decode", "nixl")


def test_table_covers_every_guard_of_the_family() -> None:
    owners = {h.owner for h in v049.HOOKS}
    assert owners == {"admission", "retire", "coverage", "abort_notify", "startup"}
    assert set(v049.ROLES_BY_OWNER) == owners


def test_pending_rejection_reads_either_field_the_family_writes() -> None:
    """0.4.9 records SGLang's own rejection in ``finished_reason``; 0.5.4.post2 on, in ``to_finish`` (a reader of
    one field alone would let those releases' stubbed requests through both doors)."""
    old, new = types.SimpleNamespace(), types.SimpleNamespace()
    old.finished_reason = FINISH_ABORT("too long (0.4.9)", 400)
    new.to_finish, new.finished_reason = FINISH_ABORT("too long (0.5.18)", 400), None
    assert v049.pending_rejection(old).message == "too long (0.4.9)"
    assert v049.pending_rejection(new).message == "too long (0.5.18)"
    assert v049.pending_rejection(types.SimpleNamespace(to_finish=None, finished_reason=None)) is None


def test_abort_streams_through_whichever_streamer_the_release_has() -> None:
    """0.4.9's scheduler streams itself; 0.5.x moved ``stream_output`` onto ``scheduler.output_streamer`` (calling the
    old name there raised AttributeError, so a guard's refusal never reached the client). An abort still pending in
    ``to_finish`` is replaced by ours."""
    streamed: list[tuple[str, Any]] = []
    old = types.SimpleNamespace(stream_output=lambda reqs, lp: streamed.append(("scheduler", reqs[0].rid)))
    new = types.SimpleNamespace(output_streamer=types.SimpleNamespace(
        stream_output=lambda reqs, lp: streamed.append(("output_streamer", reqs[0].rid))))
    first, second = Req("r1", [1, 2]), Req("r2", [1, 2])
    second.to_finish = FINISH_ABORT("pending", 400)  # type: ignore[attr-defined]
    v049._abort_and_stream(old, first, "refused", 400)
    v049._abort_and_stream(new, second, "refused", 400)
    assert streamed == [("scheduler", "r1"), ("output_streamer", "r2")]
    assert second.to_finish is None  # type: ignore[attr-defined]


def test_is_aborted_sees_a_pending_abort_in_either_place() -> None:
    assert v049.is_aborted(types.SimpleNamespace(to_abort=True))
    assert v049.is_aborted(types.SimpleNamespace(to_finish=FINISH_ABORT("x")))
    assert not v049.is_aborted(types.SimpleNamespace(to_abort=False, to_finish=None))
