"""Checksum guard across tensor-parallel ranks on a real PD pair: prefill TP 1, decode ``--tp-size 2`` (CPU,
one core per rank, ``SGLANG_CPU_OMP_THREADS_BIND=0|1``), tiny model with 2 KV heads, so each decode rank holds
one head and compares it with the matching head of prefill's single shard.

- A clean request is verified on both ranks and answered (before the attention-TP rank was read where each pin
  keeps it, rank 1 took itself for rank 0, compared the wrong head and aborted every request: a false abort).
- One bit flipped on decode rank 1 only (test shim ``flip@1:<room>``): vanilla answers 200 (shown on the newest CI
  pin; every CI pin's vanilla serves a flipped bit in ``test_paged_profile_e2e.py``); hardened aborts the request
  on both ranks (rank 0 saw nothing wrong itself) within a bound, naming rank 1.

The pins are the CI pins, which read the rank from different places (0.5.19: the scheduler's ``ps``; 0.5.23:
``runtime_context.get_parallel()``). CI runs 0.5.23 here and leaves 0.5.19's pair to the full run; the in-process
digest tests read 0.5.19's ``ps`` on both CI pins.

A TP-2 decode is three busy processes on a 2-core machine that also runs another test worker, so only one pair
of this module runs at a time (the vanilla one first); like every testbed server they run with
``--sleep-on-idle`` (ci/pins.toml): an idle scheduler then waits on its sockets instead of spinning (a CI run
timed out booting the second pair while the first spun).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.envs import ci_pins, full_run_only
from sglang_harden.testbed.incident import tenant_a_prompt
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

pytestmark = pytest.mark.e2e

FLIP_ROOM = 7_100_001
CLEAN_ROOM = 7_100_011
WAITING_TIMEOUT_S = 60
ABORT_BOUND_S = 30.0  # below the 60 s waiting timeout; a mismatch is not reported as a missing rank (10 s)
FAULT_ENV = {"SGLANG_HARDEN_TESTBED_KV_FAULT": f"flip@1:{FLIP_ROOM}",
             "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S)}
# abort_notify off too: the checksum's routes and feed must not depend on it (they used to be installed by its hooks,
# and decode read the missing routes as "prefill not hardened" and skipped the check; issue 16)
DIGEST_ONLY = {"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CAPACITY": "log", "SGLANG_HARDEN_COVERAGE": "off",
               "SGLANG_HARDEN_PAGE_TAGS": "off", "SGLANG_HARDEN_CANARY": "log", "SGLANG_HARDEN_ABORT_NOTIFY": "off"}
DECODE_TP2 = ["--tp-size", "2"]
# Vanilla serves a flipped bit whatever the rank; one pin shows it on two ranks (a TP-2 pair is ~1.3 pairs' boot).
# the CI pin CI runs this module on (the other is in ci/pins.toml [ci].full_run_only)
VANILLA_PIN = next(pin for pin in reversed(ci_pins()) if f"test_digest_tp2_e2e.py::{pin}" not in full_run_only())
DECODE_TP2_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}


def _say(msg: str) -> None:
    print(f"[digest-tp2-e2e] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module", params=ci_pins())
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    require_pin(str(request.param))
    return str(request.param)


class OnePairAtATime:
    """Starts the pair a test asks for, stopping the other one first; stops whatever runs at the end."""

    def __init__(self, pin: str, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.pin, self._tmp = pin, tmp_path_factory
        self.kind: str | None = None
        self.pair: PDPair | None = None

    def __getitem__(self, kind: str) -> PDPair:
        if self.kind != kind:
            self.stop()
            log_dir: Path = self._tmp.mktemp(f"digest-tp2-{self.pin}-{kind}")
            _say(f"{self.pin}: starting {kind} pair, decode --tp-size 2 (logs {log_dir})")
            self.pair = _start(self.pin, kind == "hardened", log_dir)
            self.kind = kind
        assert self.pair is not None
        return self.pair

    def stop(self) -> None:
        if self.pair is not None:
            self.pair.stop()
        self.pair, self.kind = None, None


@pytest.fixture(scope="module")
def pairs(pin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnePairAtATime]:
    holder = OnePairAtATime(pin, tmp_path_factory)
    try:
        yield holder
    finally:
        holder.stop()


def _start(pin: str, hardened: bool, log_dir: Path) -> PDPair:
    pair = PDPair(
        pin,
        prefill_max_total_tokens=2048,
        decode_max_total_tokens=2048,
        context_length=1024,
        decode_flags=DECODE_TP2,  # every testbed server already sleeps when idle (ci/pins.toml)
        env={**FAULT_ENV, **(DIGEST_ONLY if hardened else {})},
        decode_env=DECODE_TP2_ENV,
        launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
        log_dir=log_dir,
        progress=True,
    )
    return pair.start()



def _body(tag: str) -> dict[str, Any]:
    return greedy_body(tenant_a_prompt(11, 100), 4, rid=f"digest-tp2-{tag}")


def _run(pair: PDPair, tag: str, room: int) -> Any:
    return pair.generate(_body(tag), room=room, timeout=WAITING_TIMEOUT_S + 60)


def test_vanilla_serves_a_bit_flipped_on_one_rank(pin: str, pairs: OnePairAtATime) -> None:
    if pin != VANILLA_PIN:
        pytest.skip(f"the vanilla TP-2 pair runs on {VANILLA_PIN} only; vanilla {pin} serves a flipped bit in "
                    "test_paged_profile_e2e.py (both backends)")
    v = _run(pairs["vanilla"], "flip-vanilla", FLIP_ROOM)
    assert v.decode.ok and v.decode.output_ids, ("vanilla no longer serves a flipped bit", v.decode.summary())


def test_clean_request_is_verified_on_both_ranks(pairs: OnePairAtATime) -> None:
    hardened = pairs["hardened"]
    for server in (hardened.prefill, hardened.decode):
        armed = server.armed_schedulers()
        assert armed and all("checksum" in s.guards and "abort_notify" not in s.guards for s in armed), armed
    decisions_before = hardened.decode.harden_decisions()
    h = _run(hardened, "clean", CLEAN_ROOM)
    assert h.decode.ok and h.decode.output_ids, h.decode.summary()
    after = hardened.decode.harden_decisions()
    assert after.get("checksum:allow", 0) > decisions_before.get("checksum:allow", 0), after
    assert not after.get("checksum:abort") and not after.get("checksum:skip"), after


@pytest.mark.proves("plugin", "checksum", control="test_vanilla_serves_a_bit_flipped_on_one_rank")
def test_mismatch_on_one_rank_aborts_on_both_within_a_bound(pairs: OnePairAtATime) -> None:
    hardened = pairs["hardened"]
    before = hardened.decode.harden_decisions().get("checksum:abort", 0)
    h = _run(hardened, "flip-hardened", FLIP_ROOM)
    assert h.decode.status >= 400 and not h.decode.output_ids, h.decode.summary()
    # rank 1 refuses at its success poll (the commit gate) and SGLang's poll spreads the failure to rank 0, which
    # answers with SGLang's "from another rank"; a judgement at the commit names the rank itself
    message = h.decode.error_message()
    assert "from another rank" in message or "aborted on all ranks because rank(s) [1]" in message, h.decode.summary()
    assert "KV digest mismatch on decode rank 1" in hardened.decode.log_text(), "rank 1 did not log its reason"
    assert h.decode.elapsed_s < ABORT_BOUND_S, h.decode.summary()
    # one abort decision, on the rank that found the mismatch (rank 0's counters, which harden_decisions reads,
    # see only the failure SGLang spread; the Prometheus counter sums every scheduler process)
    aborts = [line for line in hardened.decode.log_text().splitlines()
              if "sglang_harden.decision" in line and '"guard": "checksum"' in line and '"decision": "abort"' in line
              and "flip-hardened" in line]
    assert len(aborts) == 1 and '"decode_rank": 1' in aborts[0], aborts
    assert hardened.decode.harden_decisions().get("checksum:abort", 0) in (before, before + 1)
    after = _run(hardened, "after-flip", CLEAN_ROOM + 1)  # the group is not wedged by the abort
    assert after.decode.ok and after.decode.output_ids, after.decode.summary()
