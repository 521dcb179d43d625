from sglang_harden.config import CapacityMode, Mode
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.capacity import SGLANG_MARGIN, decide_capacity, record_mode


def test_pool_that_fits_is_allowed():
    assert decide_capacity(512, 506, SGLANG_MARGIN, CapacityMode.ENFORCE).verdict is Verdict.ALLOW


def test_incident_pool_refuses_with_numbers_and_flags():
    d = decide_capacity(512, 250, SGLANG_MARGIN, CapacityMode.ENFORCE)
    assert d.verdict is Verdict.REJECT
    for text in (
        "250",
        "512",
        "--max-total-tokens",
        "--mem-fraction-static",
        "--context-length",
        "--harden-capacity clamp",
    ):
        assert text in d.reason


def test_clamp_gives_largest_fitting_context():
    d = decide_capacity(512, 250, SGLANG_MARGIN, CapacityMode.CLAMP)
    assert d.verdict is Verdict.CLAMP and d.fields["context_len"] == 256
    assert decide_capacity(256, 250, SGLANG_MARGIN, CapacityMode.ENFORCE).verdict is Verdict.ALLOW


def test_clamp_with_no_room_at_all_refuses():
    assert decide_capacity(512, 0, SGLANG_MARGIN, CapacityMode.CLAMP).verdict is Verdict.REJECT


def test_log_mode_is_a_logged_warning():
    d = decide_capacity(512, 250, SGLANG_MARGIN, CapacityMode.LOG)
    assert d.verdict is Verdict.REJECT and d.fields["log_only"] is True
    assert record_mode(CapacityMode.LOG) is Mode.LOG


def test_off_allows():
    assert decide_capacity(512, 1, SGLANG_MARGIN, CapacityMode.OFF).verdict is Verdict.ALLOW
    assert record_mode(CapacityMode.CLAMP) is Mode.ENFORCE
