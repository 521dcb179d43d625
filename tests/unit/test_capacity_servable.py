"""The largest prompt a PD node's pool can ever serve, against the limit it advertises (issue 40 (a)).

SGLang advertises prompts below ``max_req_input_len = min(context - 1, pool - 1) - 5``, but prefill admits a
prompt only when ``L + 1 + page_size < pool`` (``PrefillAdder.add_one_req``, max_new_tokens forced to 1) and decode
only when ``ceil_page(L) + num_reserved_decode_tokens <= pool`` (``DecodePreallocQueue.pop_preallocated``). Measured
on 0.5.23 (paged16, prefill pool 256): 238 served, 239 and 240 held until the waiting timeout, then 500.
"""

from __future__ import annotations

import pytest
from fake_sglang import FakeNode, serve

from sglang_harden.cli import main
from sglang_harden.config import CapacityMode
from sglang_harden.guards.admission import AdmissionView, decide_admission
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.capacity import decide_servable, largest_servable_prompt

POOL, PAGE, RESERVED, CONTEXT = 256, 16, 32, 256
LIMIT = min(CONTEXT - 1, POOL - 1) - 5  # SGLang's max_req_input_len: 250, prompts up to 249 accepted


def test_prefill_servable_prompt_is_pool_minus_a_page_minus_two() -> None:
    assert largest_servable_prompt("prefill", POOL, PAGE) == 238  # measured: 238 served, 239 held
    assert largest_servable_prompt("prefill", POOL, 1) == 253  # page 1: above the advertised 249, no gap
    assert largest_servable_prompt("prefill", 512, 64) == 446


def test_decode_servable_prompt_rounds_to_pages_after_the_reserve() -> None:
    assert largest_servable_prompt("decode", POOL, PAGE, RESERVED) == 224
    assert largest_servable_prompt("decode", 250, PAGE, RESERVED) == 208  # 218 rounds down to whole pages
    assert largest_servable_prompt("decode", 400, 1, RESERVED) == 368


def test_roles_outside_pd_are_not_modelled() -> None:
    assert largest_servable_prompt("mixed", POOL, PAGE) is None
    assert decide_servable("mixed", None, LIMIT, CapacityMode.ENFORCE).verdict is Verdict.ALLOW


def test_a_start_up_limit_the_pool_cannot_serve_is_warned_naming_the_gap() -> None:
    d = decide_servable("prefill", 238, LIMIT, CapacityMode.ENFORCE)
    assert d.verdict is Verdict.REJECT and d.fields["log_only"] is True  # the node starts; the doors refuse the gap
    assert d.fields["servable_prompt"] == 238
    for text in ("up to 249", "max_req_input_len=250", "serves at most 238", "239..249", "refuse",
                 "--context-length to 245"):
        assert text in d.reason, (text, d.reason)


def test_the_boundary_is_exact() -> None:
    # max_req_input_len 239 advertises 238 = servable: allowed; 240 advertises 239: warned
    assert decide_servable("prefill", 238, 239, CapacityMode.ENFORCE).allows
    assert not decide_servable("prefill", 238, 240, CapacityMode.ENFORCE).allows
    decode = largest_servable_prompt("decode", POOL, PAGE, RESERVED)
    assert decide_servable("decode", decode, 225, CapacityMode.ENFORCE).allows
    assert not decide_servable("decode", decode, 226, CapacityMode.ENFORCE).allows


def test_page_one_prefill_with_sglangs_own_limit_is_allowed() -> None:
    assert decide_servable("prefill", largest_servable_prompt("prefill", POOL, 1), LIMIT, CapacityMode.ENFORCE).allows


def test_every_mode_but_off_warns() -> None:
    for mode in (CapacityMode.LOG, CapacityMode.CLAMP, CapacityMode.ENFORCE):
        assert decide_servable("prefill", 238, LIMIT, mode).fields.get("log_only") is True
    assert decide_servable("prefill", 238, LIMIT, CapacityMode.OFF).allows


def test_the_door_refuses_a_prompt_the_pool_cannot_serve_at_once() -> None:
    def view(prompt_len: int) -> AdmissionView:
        return AdmissionView("r1", "prefill", prompt_len, None, LIMIT, servable=238)

    assert decide_admission(view(238)).allows
    refused = decide_admission(view(239))
    assert refused.verdict is Verdict.REJECT and refused.status_code == 400
    assert "239 tokens" in refused.reason and "(238 tokens" in refused.reason, refused.reason
    assert refused.fields["servable"] == 238
    assert decide_admission(AdmissionView("r1", "prefill", 239, None, LIMIT)).allows  # not modelled: limit only


class PagedNode(FakeNode):
    """A fake node that also reports its page size and decode reserve, as SGLang's server info does."""

    def __init__(self, page_size: int, reserved: int, **kwargs: object) -> None:
        super().__init__(guards={"capacity": {"allow": 1}}, **kwargs)  # type: ignore[arg-type]
        self.page_size, self.reserved = page_size, reserved

    def server_info(self) -> dict[str, object]:
        return {**super().server_info(), "page_size": self.page_size, "num_reserved_decode_tokens": self.reserved}


def _audit(capsys: pytest.CaptureFixture[str], *urls: str) -> tuple[int, list[dict[str, str]]]:
    import json

    code = main(["audit", *urls, "--json", "--timeout", "15"])
    return code, json.loads(capsys.readouterr().out)["findings"]


def test_audit_flags_a_paged_prefill_whose_limit_the_pool_cannot_serve(capsys: pytest.CaptureFixture[str]) -> None:
    prefill = PagedNode(PAGE, 512, role="prefill", context_length=CONTEXT, pool_tokens=POOL)
    decode = PagedNode(PAGE, RESERVED, role="decode", context_length=CONTEXT, pool_tokens=512)
    with serve(prefill.routes()) as p, serve(decode.routes()) as d:
        code, found = _audit(capsys, p, d)
    assert code == 1
    unservable = [f for f in found if f["code"] == "prompt_limit_unservable"]
    assert [f["node"] for f in unservable] == [p.rstrip("/")], found
    assert "serves at most 238" in unservable[0]["message"] and "239..249" in unservable[0]["message"]


def test_audit_flags_a_decode_whose_reserve_eats_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    decode = PagedNode(PAGE, RESERVED, role="decode", context_length=CONTEXT, pool_tokens=POOL)
    with serve(decode.routes()) as d:
        code, found = _audit(capsys, d)
    assert code == 1
    assert [f["code"] for f in found] == ["prompt_limit_unservable"], found
    assert "serves at most 224" in found[0]["message"] and "32 reserved decode tokens" in found[0]["message"]


def test_audit_passes_a_page_one_pair(capsys: pytest.CaptureFixture[str]) -> None:
    prefill = PagedNode(1, 512, role="prefill", context_length=CONTEXT, pool_tokens=POOL)
    decode = PagedNode(1, 4, role="decode", context_length=CONTEXT, pool_tokens=POOL)
    with serve(prefill.routes()) as p, serve(decode.routes()) as d:
        code, found = _audit(capsys, p, d)
    assert (code, found) == (0, [])
