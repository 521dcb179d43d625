"""sglang-harden beside another process-wide import hook (issue 19), on real PD pairs per CI pin (Mooncake).

The testbed shim ``sglang_harden_delegating_finder`` (loaded by the testbed's ``sitecustomize`` in every server
process, SGLang's spawned schedulers included) installs a naive delegating finder, as tracing agents and test
shims do: for every ``sglang`` module it asks every other finder, sglang-harden's included, for the spec and
wraps the loader, with no re-entrancy guard. Before the fix both servers died at start-up with
``RecursionError``. Here:

- hardened incident pair (``sglang_harden.launch_server``; the ``.pth`` start-up hook arms spawned children),
  the finder right ahead of ours on prefill and right behind ours on decode: both servers start; each
  scheduler logs the guards' start-up line from its own pid (not the launcher's), and in that same pid the
  finder's line for hooked modules it loaded; tenant A is served; the oversized B gets 400 with the original
  message from prefill and from decode, and decode never generates for it;
- plugin entry point (a plain ``sglang.launch_server`` with sglang-harden merely installed, SGLANG_HARDEN_ACTIVATE
  empty so the start-up hook stays inert), the finder ahead of ours: the scheduler arms via the plugin, in its own
  pid, and its own report (``/server_info``) lists the guards. (The launcher's path is checked the same way in
  ``test_guards_e2e.py``.)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.envs import plugin_pins
from sglang_harden.testbed.incident import (
    KVTRACE_ENV,
    WAITING_TIMEOUT_ENV,
    IncidentSetup,
    first_decode_event,
    tenant_a_prompt,
    tenant_b_prompt,
)
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER, Server

pytestmark = pytest.mark.e2e

PINS = plugin_pins()  # the plugin's guards: not on a patch-only release
SETUP = IncidentSetup(waiting_timeout_s=60)
FINDER_ENV = "SGLANG_HARDEN_TESTBED_DELEGATING_FINDER"
HARDEN_ENV = {"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CAPACITY": "log"}
TOO_LONG = "exceeds the maximum allowed length"
# Decode hears of prefill's refusal instead of sitting out its 60 s waiting timeout (loaded CI host: generous).
REFUSAL_BOUND_S = 30.0
POSITION = {"prefill": "before", "decode": "after"}
FINDER = re.compile(r"sglang-harden-testbed delegating-finder: loaded (\S+) pid=(\d+) position=(\S+) inner=(\S+)")


PLUGIN_API_FROM = (0, 5, 11)


def _version(pin: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", pin)[:3])


def _say(msg: str) -> None:
    print(f"[importhook-e2e] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module", params=PINS)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    """Module-scoped, so pytest runs every test of one pin before starting the next pin's servers."""
    require_pin(request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def pair(pin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    """The hardened incident pair of this pin with the delegating finder on both servers; stopped at the end."""
    log_dir: Path = tmp_path_factory.mktemp(f"importhook-{pin}")
    _say(f"{pin}: starting hardened pair beside a delegating finder (logs {log_dir})")
    pd = PDPair(
        pin,
        prefill_max_total_tokens=SETUP.prefill_max_total_tokens,
        decode_max_total_tokens=SETUP.decode_max_total_tokens,
        context_length=SETUP.context_length,
        num_reserved_decode_tokens=SETUP.num_reserved_decode_tokens,
        env={WAITING_TIMEOUT_ENV: str(SETUP.waiting_timeout_s), **HARDEN_ENV},
        prefill_env={FINDER_ENV: POSITION["prefill"]},
        decode_env={FINDER_ENV: POSITION["decode"], KVTRACE_ENV: str(log_dir / "kvtrace")},
        launcher_module=HARDENED_LAUNCHER,
        log_dir=log_dir,
        progress=True,
    )
    with pd:
        yield pd


def _finder_loads(server: Server) -> list[tuple[str, int, str, str]]:
    return [(m[0], int(m[1]), m[2], m[3]) for m in FINDER.findall(server.log_text())]


def test_plugin_entry_point_arms_beside_a_delegating_finder(pin: str, tmp_path: Path) -> None:
    """A plain ``sglang.launch_server`` with sglang-harden installed (SGLang's plugin API, both CI pins). First in
    the module, so it runs before this pin's pair starts (one server at a time on a 2-core host)."""
    if _version(pin) < PLUGIN_API_FROM:
        pytest.skip(f"SGLang {pin} has no plugin API (0.5.11+); the launcher path covers it (test_guards_e2e.py)")
    env = {"SGLANG_HARDEN_ACTIVATE": "", FINDER_ENV: "before"}
    server = Server(
        pin,
        "mixed",
        max_total_tokens=2048,
        env=env,
        launcher_module=VANILLA_LAUNCHER,
        log_dir=tmp_path,
        startup_timeout=900.0,
    )
    with server:
        armed = server.armed_schedulers()
        assert armed, server.log_tail()
        assert all(a.pin == pin and a.via == "plugin" and a.pid != server.pid for a in armed), armed
        assert any(pos == "before" for _m, _p, pos, _i in _finder_loads(server)), server.log_tail()
        report = server.harden_state()
        assert report.get("pin") == pin and "admission" in report.get("guards", []), report


def test_both_servers_start_with_guards_armed_in_their_schedulers(pair: PDPair, pin: str) -> None:
    for server in (pair.prefill, pair.decode):
        assert server.is_alive(), server.log_tail()
        assert "RecursionError" not in server.log_text(), server.log_tail()
        armed = [a for a in server.armed_schedulers() if a.role == server.role]
        assert armed, server.log_tail()
        for a in armed:
            assert a.pin == pin and a.pid != server.pid, armed
            assert {"admission", "retire", "coverage", "abort_notify"} <= set(a.guards), armed


def test_delegating_finder_loaded_hooked_modules_in_the_armed_schedulers(pair: PDPair) -> None:
    """The other finder really sat in the chain, for modules we hook, in the processes where the guards armed."""
    for server in (pair.prefill, pair.decode):
        loads = _finder_loads(server)
        assert loads, server.log_tail()
        assert {pos for _m, _p, pos, _i in loads} == {POSITION[server.role]}, loads
        scheduler_pids = {a.pid for a in server.armed_schedulers() if a.role == server.role}
        in_schedulers = {module for module, pid, _pos, _inner in loads if pid in scheduler_pids}
        assert "sglang.srt.managers.scheduler" in in_schedulers, (scheduler_pids, loads)


def test_incident_still_blocked(pair: PDPair) -> None:
    a = pair.generate(greedy_body(tenant_a_prompt(1, SETUP.a_len), SETUP.new_tokens, rid="coexist-A"))
    assert a.prefill.ok and a.decode.ok and a.decode.output_ids, (a.prefill.summary(), a.decode.summary())
    b = pair.generate(
        greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid="coexist-B"),
        timeout=SETUP.waiting_timeout_s + 60,
    )
    for half in (b.prefill, b.decode):
        assert half.status == 400, half.summary()
        assert TOO_LONG in half.error_message(), half.error_message()
        assert half.output_ids is None, half.summary()
    assert b.decode.elapsed_s < REFUSAL_BOUND_S, b.decode.summary()
    assert first_decode_event(pair.log_dir / "kvtrace", "coexist-B") is None, "decode generated for rejected B"
