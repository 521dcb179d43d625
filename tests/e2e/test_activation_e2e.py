"""The guards are armed in SGLang's scheduler subprocesses, not only in the process that was started.

SGLang starts its scheduler with multiprocessing's ``spawn``: a child re-imports SGLang from scratch, so a
patch made in the parent proves nothing. Each scheduler logs ``sglang-harden active: … pid=… via=…`` from
inside its own ``Scheduler.__init__``; the tests check that line comes from a pid other than the server's
main process, and that the hooks really act there (``/server_info`` carries the scheduler's own report).

- plugin entry point: a plain ``python -m sglang.launch_server`` with sglang-harden merely installed (pins
  with SGLang's plugin API, 0.5.11+);
- launcher: ``python -m sglang_harden.launch_server`` (every pin; the start-up hook arms spawned children).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from sglang_harden.testbed.envs import load_pins
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER, Server

pytestmark = pytest.mark.e2e

PINS = list(load_pins())
PLUGIN_API_FROM = (0, 5, 11)
ACTIVE = re.compile(r"sglang-harden active: pin=(\S+) family=\S+ role=scheduler/(\S+) pid=(\d+) via=(\S+)")


def _version(pin: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", pin)[:3])


def _armed_schedulers(server: Server) -> list[tuple[str, str, int, str]]:
    return [(m[0], m[1], int(m[2]), m[3]) for m in ACTIVE.findall(server.log_text())]


def _report(server: Server) -> dict[str, Any]:
    return (server.server_info().get("internal_states") or [{}])[0].get("sglang_harden") or {}


@pytest.mark.parametrize("pin", PINS)
def test_plugin_entry_point_arms_scheduler_subprocess(pin: str, require_pin: Any, tmp_path: Any) -> None:
    require_pin(pin)
    if _version(pin) < PLUGIN_API_FROM:
        pytest.skip(f"SGLang {pin} has no plugin API; the launcher path covers it (test below)")
    # SGLANG_HARDEN_ACTIVATE empty: the start-up hook stays inert, only SGLang's load_plugins() can arm us.
    server = Server(pin, "mixed", max_total_tokens=2048, env={"SGLANG_HARDEN_ACTIVATE": ""},
                    launcher_module=VANILLA_LAUNCHER, log_dir=tmp_path, startup_timeout=900.0)
    with server:
        armed = _armed_schedulers(server)
        assert armed, server.log_tail()
        assert all(a[0] == pin and a[3] == "plugin" and a[2] != server.pid for a in armed), armed
        assert "admission" in _report(server).get("guards", []), _report(server)


@pytest.mark.parametrize("pin", PINS)
def test_launcher_arms_scheduler_subprocess(pin: str, require_pin: Any, tmp_path: Any) -> None:
    require_pin(pin)
    server = Server(pin, "mixed", max_total_tokens=2048, env={"SGLANG_HARDEN_ACTIVATE": "1"},
                    launcher_module=HARDENED_LAUNCHER, log_dir=tmp_path, startup_timeout=900.0)
    with server:
        armed = _armed_schedulers(server)
        assert armed, server.log_tail()
        assert all(a[0] == pin and a[2] != server.pid for a in armed), armed
        assert _report(server).get("pin") == pin, _report(server)
