"""Checksum guard (per-transfer KV digest) on real SGLang PD pairs (tiny model, loopback), vanilla vs hardened.

Faults are injected on decode by the test-only ``sglang_harden_kvfault`` shim, chosen per bootstrap room:

- ``flip``: one bit of one received KV row is flipped right before decode commits the transfer;
- ``unwritten``: prefill's send leaves out the request's last page and still reports success, so decode's
  last reserved page keeps what it held before (the incident's stale page);
- short send: prefill runs with ``--allow-auto-truncate`` and a prompt over its limit, so it sends KV for 250
  of the 300 tokens decode reserved.

Vanilla decode answers 200 for all three. The hardened pair runs with the coverage and page-tag guards off and
the canary in ``log`` mode, so the digest alone has to catch each one (abort before the first decode step,
``checksum:abort`` counted), while the canary's own verdict on the unwritten page is counted as
``canary:abort_logged``; clean requests are compared, not skipped (``checksum:allow`` and ``canary:allow``
counted, no ``checksum:skip``), and answer exactly what vanilla answers. Pins: those whose family carries
the checksum hooks (0.5.x; 0.4.9.post6 has none, see docs/guards.md), on Mooncake and on NIXL where the pin's recipe
lists it.

The faults are sized for 1-token pages: these are cases of the ``minimal`` testbed profile, run with
``--profiles all``. CI proves the digest on the production-shaped ``paged16`` profile in
``test_paged_profile_e2e.py`` (a flipped bit found, clean requests compared, on every CI pin and backend) and its
enforcement on two decode ranks in ``test_digest_tp2_e2e.py``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.compat import SUPPORTED_PINS
from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.envs import load_pins, plugin_pins
from sglang_harden.testbed.incident import IncidentSetup, tenant_a_prompt, tenant_b_prompt
from sglang_harden.testbed.pd_topology import PDPair, stop_together
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

pytestmark = pytest.mark.e2e

SETUP = IncidentSetup(waiting_timeout_s=60)
FLIP_ROOM = 7_000_001
UNWRITTEN_ROOM = 7_000_002
UNWRITTEN_LEN = 137  # a send of exactly this many pages (page size 1) loses its last page
SHORT_ROOM = 7_000_003
CLEAN_ROOMS = (7_000_011, 7_000_012)
FAULT_ENV = {"SGLANG_HARDEN_TESTBED_KV_FAULT": f"flip:{FLIP_ROOM},unwritten:{UNWRITTEN_LEN}"}
# Only the digest stands: the cheaper guards that would also see a short send or a foreign page are off.
DIGEST_ONLY = {"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CAPACITY": "log", "SGLANG_HARDEN_COVERAGE": "off",
               "SGLANG_HARDEN_PAGE_TAGS": "off", "SGLANG_HARDEN_CANARY": "log"}
ABORT_BOUND_S = 30.0  # far below the 60 s waiting timeout; a loaded 2-core CI host has taken 16 s to prefill


def _has_digest(pin: str) -> bool:
    family = importlib.import_module(f"sglang_harden.compat.{SUPPORTED_PINS[pin]}")
    return any(hook.owner == "checksum" for hook in family.HOOKS)


CASES = [f"{pin}/{backend}/minimal" for pin, recipe in load_pins().items() if pin in plugin_pins() and _has_digest(pin)
         for backend in ("mooncake", "nixl") if backend in recipe.transfer_backends]


def _say(msg: str) -> None:
    print(f"[digest-e2e] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module", params=CASES)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    """``<pin>/<transfer backend>/minimal``; module-scoped, so one case's pairs serve all its tests."""
    require_pin(str(request.param))
    return str(request.param)


@pytest.fixture(scope="module")
def pairs(pin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, PDPair]]:
    version, backend, _profile = pin.split("/")
    started: dict[str, PDPair] = {}
    try:
        for kind in ("vanilla", "hardened"):
            log_dir: Path = tmp_path_factory.mktemp(f"digest-{version}-{backend}-{kind}")
            _say(f"{version}/{backend}: starting {kind} pair (logs {log_dir})")
            started[kind] = _start(version, backend, kind == "hardened", log_dir)
        yield started
    finally:
        stop_together([part for pair in started.values() for part in pair.parts()])


def _start(pin: str, backend: str, hardened: bool, log_dir: Path) -> PDPair:
    env = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(SETUP.waiting_timeout_s), **FAULT_ENV}
    if hardened:
        env.update(DIGEST_ONLY)
    pair = PDPair(
        pin,
        prefill_max_total_tokens=SETUP.prefill_max_total_tokens,
        decode_max_total_tokens=SETUP.decode_max_total_tokens,
        context_length=SETUP.context_length,
        num_reserved_decode_tokens=SETUP.num_reserved_decode_tokens,
        transfer_backend=backend,
        prefill_flags=["--allow-auto-truncate"],
        env=env,
        launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
        log_dir=log_dir,
        progress=True,
    )
    return pair.start()



def _body(tag: str, seed: int = 3, length: int = 120) -> dict[str, Any]:
    return greedy_body(tenant_a_prompt(seed, length), 8, rid=f"digest-{tag}")


def _run(pair: PDPair, body: dict[str, Any], room: int) -> Any:
    return pair.generate(body, room=room, timeout=SETUP.waiting_timeout_s + 60)


def _assert_vanilla_serves(pairs: dict[str, PDPair], body: dict[str, Any], room: int) -> None:
    v = _run(pairs["vanilla"], body, room)
    assert v.decode.ok and v.decode.output_ids, ("vanilla no longer serves this fault", v.decode.summary())


def _assert_digest_aborts(pairs: dict[str, PDPair], body: dict[str, Any], room: int, message: str) -> None:
    before = pairs["hardened"].decode.harden_decisions().get("checksum:abort", 0)
    h = _run(pairs["hardened"], body, room)
    assert h.decode.status >= 400 and not h.decode.output_ids, h.decode.summary()
    assert message in h.decode.error_message(), h.decode.summary()
    assert h.decode.elapsed_s < ABORT_BOUND_S, h.decode.summary()
    assert pairs["hardened"].decode.harden_decisions().get("checksum:abort", 0) == before + 1


def test_clean_requests_are_verified_and_unchanged(pairs: dict[str, PDPair]) -> None:
    outputs = {}
    for kind, pair in pairs.items():
        results = [_run(pair, _body(f"clean-{kind}-{i}", seed=20 + i), room) for i, room in enumerate(CLEAN_ROOMS)]
        assert all(r.decode.ok for r in results), [r.decode.summary() for r in results]
        outputs[kind] = [r.decode.output_ids for r in results]
    assert outputs["hardened"] == outputs["vanilla"]
    decisions = pairs["hardened"].decode.harden_decisions()
    assert decisions.get("checksum:allow", 0) >= len(CLEAN_ROOMS), decisions
    assert decisions.get("canary:allow", 0) >= len(CLEAN_ROOMS), decisions
    assert decisions.get("checksum:skip", 0) == 0, decisions
    # The ledger learns a transfer finished without the page-tag hook: clean requests' pages are freed,
    # not quarantined.
    assert decisions.get("lifecycle:quarantine", 0) == 0, decisions
    # Decode's feed reader had the digests of the rooms it watched from its start; the first room of a reader
    # (registered before it had a cursor) is read from prefill's board.
    fetches = _decode_digest_time(pairs["hardened"])
    assert fetches.get("verify.fetch.feed", {}).get("count", 0) >= len(CLEAN_ROOMS) - 1, fetches


def _decode_digest_time(pair: PDPair) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for state in pair.decode.server_info().get("internal_states") or []:
        found.update(((state or {}).get("sglang_harden") or {}).get("digest_time") or {})
    return found


@pytest.mark.proves("plugin", "checksum", control="self")
def test_flipped_bit_is_caught(pairs: dict[str, PDPair]) -> None:
    _assert_vanilla_serves(pairs, _body("flip-v"), FLIP_ROOM)
    _assert_digest_aborts(pairs, _body("flip-h"), FLIP_ROOM, "KV digest mismatch")


@pytest.mark.proves("plugin", "checksum", control="self")
def test_unwritten_page_is_caught(pairs: dict[str, PDPair]) -> None:
    _assert_vanilla_serves(pairs, _body("unwritten-v", length=UNWRITTEN_LEN), UNWRITTEN_ROOM)
    canary_before = pairs["hardened"].decode.harden_decisions().get("canary:abort_logged", 0)
    _assert_digest_aborts(pairs, _body("unwritten-h", length=UNWRITTEN_LEN), UNWRITTEN_ROOM, "KV digest mismatch")
    assert pairs["hardened"].decode.harden_decisions().get("canary:abort_logged", 0) == canary_before + 1


@pytest.mark.proves("plugin", "checksum", control="self")
def test_short_send_is_caught(pairs: dict[str, PDPair]) -> None:
    body = greedy_body(tenant_b_prompt(SETUP.b_len), 8, rid="digest-short")
    _assert_vanilla_serves(pairs, body, SHORT_ROOM)
    _assert_digest_aborts(pairs, body, SHORT_ROOM, "vouched for KV of tokens [0, 250)")
