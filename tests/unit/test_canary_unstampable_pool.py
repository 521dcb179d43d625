"""A decode pool the canary cannot stamp (a hybrid pool's wrapper, as SGLang's SWAKVPool on a sliding-window model
in log mode) leaves the room unstamped instead of killing the scheduler; the commit gate then refuses the room as
unverified (tests/e2e/test_swa_shape_e2e.py shows it on a real node)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_harden.compat import kv_canary
from sglang_harden.guards.base import Verdict


def test_an_unstampable_pool_leaves_the_room_to_fail_closed_at_the_commit(caplog: pytest.LogCaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_canary, "STAMPS", kv_canary.Stamps())
    monkeypatch.setattr(kv_canary, "_warned", set())
    monkeypatch.setattr(kv_canary, "UNSTAMPABLE", kv_canary.OrderedDict())
    pool = type("SWAKVPool", (), {"page_size": 16})()
    with caplog.at_level(logging.WARNING, logger="sglang_harden"):
        kv_canary._stamp(4242, [3, 4], pool)
        kv_canary._stamp(4243, [5], pool)
    assert not kv_canary.STAMPS.has(4242)
    assert caplog.text.count("decode's KV pool SWAKVPool cannot be stamped") == 1
    step = kv_canary.canary_step()
    monkeypatch.setattr(kv_canary.RUNTIME, "decode_kv_pool", pool)
    decode_req = SimpleNamespace(req=SimpleNamespace(rid="r-swa", bootstrap_room=4242))
    decision = step.decide(None, decode_req, step.launch(None, decode_req))
    assert decision is not None and decision.verdict is Verdict.ABORT, decision
    assert "decode's KV pool SWAKVPool cannot be stamped: AttributeError" in decision.reason, decision.reason
