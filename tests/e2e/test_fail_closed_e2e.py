"""Fail closed on real servers: a hardened server whose SGLang code moved, or whose SGLang release is not a supported
pin, refuses to start (non-zero exit, a message naming why) on every activation path:

- launcher: ``python -m sglang_harden.launch_server`` (sets ``SGLANG_HARDEN_ACTIVATE=1``);
- start-up hook: a plain ``python -m sglang.launch_server`` with ``SGLANG_HARDEN_ACTIVATE=1`` (the ``.pth`` file);
- plugin: a plain ``python -m sglang.launch_server`` with sglang-harden merely installed (SGLang's
  ``sglang.srt.plugins`` entry point; pins with the plugin API). The server's main process loads plugins before
  it imports the scheduler, so the moved target fails that import. (Where plugins load after the module was
  imported, as in a scheduler process, the hook installs at once inside ``plugin.load``, which SGLang runs under
  ``except Exception``; ``plugin.load`` turns any failure into SystemExit(78): ``tests/unit/test_plugin.py``.)

"Code moved" is the test-only ``breakhook`` shim (``SGLANG_HARDEN_TESTBED_BREAK_HOOK``): a hook target removed,
or its signature changed, before any hook sees the module. "Not a supported pin" is a ``sglang-0.5.99``
distribution record placed first on the path, so ``importlib.metadata`` reports that version (SGLang's code
itself is the pin's). A vanilla server with the same shim starts and serves: the refusal is ours.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sglang_harden.testbed.procenv import CHECKOUT, SHIMS_DIR
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER, Server, ServerError

pytestmark = pytest.mark.e2e

PINS = ["0.5.19", "0.5.23"]
TARGET = "sglang.srt.disaggregation.decode:DecodePreallocQueue.add"
TARGET_NAME = "DecodePreallocQueue.add"
# CPU test speed only: SGLang waits 60 s for CUDA core dumps when a child dies.
FAST_CRASH = {"SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0"}
PATHS = {
    "launcher": (HARDENED_LAUNCHER, {"SGLANG_HARDEN_ACTIVATE": "1"}),
    "startup-hook": (VANILLA_LAUNCHER, {"SGLANG_HARDEN_ACTIVATE": "1"}),
    "plugin": (VANILLA_LAUNCHER, {"SGLANG_HARDEN_ACTIVATE": ""}),
}
STARTUP_TIMEOUT_S = 300.0


@pytest.fixture(scope="module", params=PINS)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    require_pin(request.param)
    return str(request.param)


def _refusal(pin: str, path: str, env: dict[str, str], log_dir: Path) -> tuple[int | None, str]:
    """Start one server on ``path``; it must not come up. Returns (exit code, log)."""
    launcher, activation = PATHS[path]
    server = Server(pin, "mixed", max_total_tokens=2048, env={**FAST_CRASH, **activation, **env},
                    launcher_module=launcher, log_dir=log_dir, startup_timeout=STARTUP_TIMEOUT_S)
    try:
        with pytest.raises(ServerError, match="exited with code"):
            server.start().wait_ready()
    finally:
        server.stop()
    return server.proc.returncode, server.log_text()


def _fake_release(root: Path, version: str) -> Path:
    info = root / f"sglang-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return root


# Each path once with the target removed; the plugin path (the one that served unguarded) also with it re-signed.
MOVED = [("launcher", "remove"), ("startup-hook", "resign"), ("plugin", "remove"), ("plugin", "resign")]


@pytest.mark.parametrize(("path", "change"), MOVED)
def test_moved_hook_target_refuses_to_start(pin: str, path: str, change: str, tmp_path: Path) -> None:
    code, log = _refusal(pin, path, {"SGLANG_HARDEN_TESTBED_BREAK_HOOK": f"{change}:{TARGET}"}, tmp_path)
    assert code != 0, log[-3000:]
    assert TARGET_NAME in log and ("not found" if change == "remove" else "expected parameters") in log, log[-3000:]


@pytest.mark.parametrize("path", list(PATHS))
def test_unlisted_release_refuses_to_start(pin: str, path: str, tmp_path: Path) -> None:
    fake = _fake_release(tmp_path / "fake-dist", "0.5.99")
    env = {"PYTHONPATH": os.pathsep.join(map(str, (fake, SHIMS_DIR, CHECKOUT)))}
    code, log = _refusal(pin, path, env, tmp_path / "logs")
    assert code == 78 or (path == "plugin" and code != 0), log[-3000:]
    assert "SGLang 0.5.99 is not a supported pin" in log and "Refusing to start unguarded" in log, log[-3000:]


def test_vanilla_server_with_the_moved_target_serves(pin: str, tmp_path: Path) -> None:
    """The shim alone breaks nothing SGLang needs at start-up: the refusals above are sglang-harden's."""
    env = {**FAST_CRASH, "SGLANG_HARDEN_TESTBED_BREAK_HOOK": f"resign:{TARGET}"}
    with Server(pin, "mixed", max_total_tokens=2048, env=env, launcher_module=VANILLA_LAUNCHER, log_dir=tmp_path,
                startup_timeout=STARTUP_TIMEOUT_S) as server:
        assert server.is_alive()
