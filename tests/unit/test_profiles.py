"""Testbed serving profiles: the flags and environment each one gives a server."""

from __future__ import annotations

import pytest

from sglang_harden.testbed.profiles import EARLY_SEND_ENV, PROFILE_ENV, default_profile, get_profile


def test_minimal_is_what_the_testbed_always_ran() -> None:
    minimal = get_profile("minimal")
    assert minimal.server_flags() == ["--disable-radix-cache"]
    assert minimal.server_env() == {}
    assert minimal.dropped_env() == ()


def test_paged16_is_production_shaped() -> None:
    paged = get_profile("paged16")
    flags = paged.server_flags()
    assert flags[flags.index("--page-size") + 1] == "16"
    assert flags[flags.index("--chunked-prefill-size") + 1] == "64"
    assert "--disable-radix-cache" not in flags
    assert paged.server_env() == {"TRITON_INTERPRET": "1"}  # CPU necessity: paged allocator's Triton kernels
    assert paged.dropped_env() == (EARLY_SEND_ENV,)  # each pin's own early-send default


def test_unknown_profile_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown testbed profile 'paged7'.*minimal"):
        get_profile("paged7")


def test_default_profile_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert default_profile().name == "minimal"
    monkeypatch.setenv(PROFILE_ENV, "paged16")
    assert default_profile().name == "paged16"
    monkeypatch.setenv(PROFILE_ENV, "nope")
    with pytest.raises(ValueError):
        default_profile()
