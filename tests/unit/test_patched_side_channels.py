"""The side-channel patch (``authenticate-side-channels``) on the venv's own SGLang: run under a pin venv's python.

The pin's series is applied to a copy of the files it touches, taken from the venv's SGLang. Then:

- SGLang's real Mooncake prefill listener (``sglang_harden.testbed.patched_side_channels``, one subprocess with the
  patched files, one with the venv's vanilla ones; same secret file, same messages): an unsigned registration lands
  on vanilla and is dropped patched; a signed one lands on both; a captured registration replayed after the victim
  registered again restores the old buffers on vanilla and is dropped patched; a malformed message kills vanilla's
  listener for good (later registrations are never processed), patched it and a handler that raises leave it
  serving; the manager's peer sockets grow without bound on vanilla and stay capped patched. On 0.5.21+ the rank
  port is read through ``_make_worker_recv``'s poll branch (role switching on).
- one wire format: a message signed by the plugin's code is admitted by the patched rank port (another secret's is
  not), and the frames the patched manager's and receiver's sockets send verify under the plugin's verifier (tampered:
  refused); in one process, the plugin's signing socket to the series' verifying one and back, on real sockets.
- the module's settings: enforce without a secret refuses to start, bad values refuse, log mode serves and counts,
  no secret signs nothing, a rotation's second secret is accepted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
sglang = pytest.importorskip("sglang")

from sglang_harden.compat import zmq_sockets as plugin_sockets  # noqa: E402
from sglang_harden.guards import zmq_auth as plugin_auth  # noqa: E402
from sglang_harden.guards.bootstrap_auth import MIN_SECRET_CHARS, parse_secrets  # noqa: E402
from sglang_harden.testbed.envs import REPO_ROOT  # noqa: E402
from sglang_harden.testbed.patched import copy_series_files  # noqa: E402
from sglang_harden.testbed.plugin_config import secret_in_force  # noqa: E402
from sglang_harden.tools import patch as patch_tool  # noqa: E402

PIN = sglang.__version__
PATCH = "authenticate-side-channels"
MODULE = "sglang/srt/disaggregation/common/pd_side_channels.py"
AUTH_MODULE = "sglang/srt/disaggregation/common/pd_auth.py"
SECRET = "s" * MIN_SECRET_CHARS
OLD = "o" * MIN_SECRET_CHARS
VENV_SGLANG = Path(sglang.__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    PIN not in patch_tool.available_pins(patch_tool.default_patches_dir())
    or not any(PATCH in p.name for p in patch_tool.load_series(PIN, patch_tool.default_patches_dir())),
    reason=f"no side-channel patch in a series for SGLang {PIN}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("patched-side-channels")
    copy_series_files(PIN, VENV_SGLANG, root / "tree")
    report = patch_tool.apply_series(root / "tree", PIN)
    assert report.ok, report.message
    (root / "secret").write_text(SECRET + "\n")
    (root / "secret").chmod(0o600)
    return root


def _drive(workdir: Path, tree: str) -> dict[str, Any]:
    polled = "def _make_worker_recv" in (VENV_SGLANG / "sglang/srt/disaggregation/common/conn.py").read_text()
    env = {**os.environ, "SGLANG_HARDEN_ACTIVATE": "0", "SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE": str(workdir / "secret"),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("SGLANG_HARDEN_ZMQ_AUTH", "SGLANG_HARDEN_ZMQ_SIGN", "SGLANG_HARDEN_SIDE_CHANNELS"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "sglang_harden.testbed.patched_side_channels", tree,
           *(["--role-switch"] if polled else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(workdir: Path) -> dict[str, dict[str, Any]]:
    return {"vanilla": _drive(workdir, "-"), "patched": _drive(workdir, str(workdir / "tree"))}


def _case(run: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in run["cases"] if c["case"] == name)


# ---------------------------------------------------------------- SGLang's real listener, vanilla and patched


def test_the_runs_are_what_they_say(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["vanilla"]["patched"] is False and runs["patched"]["patched"] is True
    assert runs["patched"]["status"] == "enforce"


def test_a_signed_registration_is_accepted(runs: dict[str, dict[str, Any]]) -> None:
    for run in runs.values():
        assert _case(run, "signed registration") == {"case": "signed registration", "listener_alive": True,
                                                     "ptr": 0xA000}, run


def test_an_unsigned_registration_is_refused(runs: dict[str, dict[str, Any]]) -> None:
    assert _case(runs["vanilla"], "unsigned registration")["ptr"] == 0xB000  # the harm: anyone registers
    refused = _case(runs["patched"], "unsigned registration")
    assert refused["ptr"] is None and refused["listener_alive"], refused
    assert runs["patched"]["counts"].get("zmq_auth/reject", 0) >= 3, runs["patched"]["counts"]


def test_a_replayed_registration_is_refused(runs: dict[str, dict[str, Any]]) -> None:
    for run in runs.values():
        replay = _case(run, "replayed registration")
        assert (replay["first"], replay["again"]) == (0xC000, 0xC100), replay
    assert _case(runs["vanilla"], "replayed registration")["ptr"] == 0xC000  # the victim's old buffers are back
    assert _case(runs["patched"], "replayed registration")["ptr"] == 0xC100


def test_a_malformed_message_does_not_end_the_listener(runs: dict[str, dict[str, Any]]) -> None:
    vanilla, patched = runs["vanilla"], runs["patched"]
    assert _case(vanilla, "unsigned malformed")["listener_alive"] is False and vanilla["deaths"], vanilla
    assert _case(vanilla, "after the failures")["ptr"] is None  # never processed: the node serves no PD request
    for name in ("unsigned malformed", "signed malformed", "handler raises", "after the failures"):
        assert _case(patched, name)["listener_alive"] is True, (name, patched)
    assert _case(patched, "after the failures")["ptr"] == 0xE000
    assert patched["deaths"] == [] and patched["counts"].get("side_channels/skip", 0) >= 1, patched


def test_plugin_and_series_speak_one_wire_format(runs: dict[str, dict[str, Any]]) -> None:
    patched = runs["patched"]
    assert _case(patched, "plugin signed")["ptr"] == 0xF000
    assert _case(patched, "plugin signed, other secret")["ptr"] is None
    expected = {"manager": ["ABORT_ACK", "7"], "receiver": ["ABORT", "7"]}
    if patched["early"]:  # the page-lifecycle patch's own drain acknowledgement (rank 0) signs too
        expected["lifecycle ack"] = ["SGH_ABORT_ACK", "7", "0"]
    assert set(patched["interop"]) == set(expected), patched["interop"]
    for who, frames in expected.items():
        seen = patched["interop"][who]
        assert seen == {"frames": frames, "signed": True, "verdict": "allow", "tampered": "reject"}, (who, seen)


def test_the_managers_peer_sockets_are_capped(runs: dict[str, dict[str, Any]]) -> None:
    if runs["patched"]["early"]:
        # 0.4.x opens a socket per send; 0.5.10.post1 caches one per endpoint with functools.cache (no cache a
        # cap could trim): the series caps nothing there, and says so in the patch's header
        assert runs["vanilla"]["peer_sockets"] is None and runs["patched"]["peer_sockets"] is None
        return
    assert runs["vanilla"]["peer_sockets"] == 8 and runs["patched"]["peer_sockets"] == 3, runs


# ---------------------------------------------------------------- the module, in this process


def _load(tree: Path, monkeypatch: pytest.MonkeyPatch, secret_file: Path | None, **env: str) -> ModuleType:
    """The series' pd_auth (as SGLang imports it) and pd_side_channels, imported from the patched files."""
    for name in ("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", "SGLANG_HARDEN_BOOTSTRAP_AUTH", "SGLANG_HARDEN_ZMQ_AUTH",
                 "SGLANG_HARDEN_ZMQ_SIGN", "SGLANG_HARDEN_SIDE_CHANNELS"):
        monkeypatch.delenv(name, raising=False)
    if secret_file is not None:
        monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", str(secret_file))
    for name, value in env.items():
        monkeypatch.setenv(f"SGLANG_HARDEN_{name.upper()}", value)
    import sglang.srt.disaggregation.common as common

    modules = {}
    for rel, name in ((AUTH_MODULE, "pd_auth"), (MODULE, "pd_side_channels")):
        spec = importlib.util.spec_from_file_location(f"{common.__name__}.{name}", tree / rel)
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        monkeypatch.setattr(common, name, module, raising=False)
        spec.loader.exec_module(module)
        modules[name] = module
    return modules["pd_side_channels"]


@pytest.fixture
def plugin(workdir: Path) -> Iterator[None]:
    """The plugin's side-channel settings with the same secret file (enforce, signing)."""
    with secret_in_force(workdir / "secret"):
        yield


@pytest.fixture
def ctx() -> Iterator[Any]:
    context = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


def _pull(ctx: Any) -> tuple[Any, str]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    return sock, f"127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _push(ctx: Any, endpoint: str) -> Any:
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://{endpoint}")
    return sock


def test_plugin_and_series_sockets_interoperate(workdir: Path, monkeypatch: pytest.MonkeyPatch, plugin: None,
                                               ctx: Any) -> None:
    """A plugin node's signing socket to a patched node's rank port, and a patched node's to a plugin node's."""
    series = _load(workdir / "tree", monkeypatch, workdir / "secret")
    series_port, series_endpoint = _pull(ctx)
    series.make_verifying(series_port, series.Inbox(series_endpoint, "prefill test"))
    plugin_port, plugin_endpoint = _pull(ctx)
    plugin_sockets.make_verifying(plugin_port, plugin_sockets.Inbox(plugin_endpoint, "decode test"))

    to_series = _push(ctx, series_endpoint)
    plugin_sockets.make_signing(to_series, f"tcp://{series_endpoint}")
    to_plugin = _push(ctx, plugin_endpoint)
    series.sign_socket(to_plugin, f"tcp://{plugin_endpoint}")
    raw = _push(ctx, series_endpoint)
    raw.send_multipart([b"forged", b"1"])  # unsigned: dropped by the series before the signed one
    to_series.send_multipart([b"from", b"plugin"])
    assert series_port.recv_multipart() == [b"from", b"plugin"]
    to_plugin.send_multipart([b"from", b"series"])
    assert plugin_port.recv_multipart() == [b"from", b"series"]
    deadline = time.monotonic() + 5  # the unsigned one came on another socket: it may arrive after the signed one
    while series.COUNTS[("zmq_auth", "reject")] == 0 and time.monotonic() < deadline:
        with pytest.raises(zmq.Again):
            series_port.recv_multipart(zmq.NOBLOCK)
        time.sleep(0.02)
    assert series.COUNTS[("zmq_auth", "reject")] == 1


def test_without_a_secret_nothing_is_signed(workdir: Path, monkeypatch: pytest.MonkeyPatch, ctx: Any) -> None:
    series = _load(workdir / "tree", monkeypatch, None)
    assert series.status() == "unauthenticated" and series.auth_state() is None
    sock = _push(ctx, "127.0.0.1:1")
    series.sign_socket(sock, "tcp://127.0.0.1:1")
    assert type(sock) is zmq.Socket


def test_settings_that_cannot_be_served_refuse_to_start(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="SGLANG_HARDEN_ZMQ_AUTH=enforce needs"):
        _load(workdir / "tree", monkeypatch, None, zmq_auth="enforce")
    for setting in ({"zmq_auth": "audit"}, {"zmq_sign": "maybe"}, {"side_channels": "on"}):
        with pytest.raises(ValueError, match="SGLANG_HARDEN_"):
            _load(workdir / "tree", monkeypatch, workdir / "secret", **setting)
    series = _load(workdir / "tree", monkeypatch, workdir / "secret", zmq_sign="0")
    assert series.status() == "enforce (not signing)"


def test_log_mode_serves_and_counts(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    series = _load(workdir / "tree", monkeypatch, workdir / "secret", zmq_auth="log")
    inbox = series.Inbox("127.0.0.1:5000", "prefill test")
    assert inbox.admit([b"unsigned"]) == [b"unsigned"]
    assert series.COUNTS[("zmq_auth", "reject_logged")] == 1
    enforcing = _load(workdir / "tree", monkeypatch, workdir / "secret")
    assert enforcing.Inbox("127.0.0.1:5000", "prefill test").admit([b"unsigned"]) is None


def test_a_rotations_second_secret_is_accepted(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    """The secret file's second line (pd_auth's rotation) verifies; a message signed with it passes the series."""
    rotating = tmp_path / "secret"
    rotating.write_text(f"{SECRET}\n{OLD}\n")
    rotating.chmod(0o600)
    series = _load(workdir / "tree", monkeypatch, rotating)
    inbox = series.Inbox("127.0.0.1:5000", "prefill test")
    frames = [b"room", b"1"]
    for secret in (OLD, SECRET):
        auth = plugin_auth.Signer().sign(parse_secrets(secret), frames, "tcp://127.0.0.1:5000")
        assert inbox.admit([*frames, auth]) == frames, secret
    stranger = plugin_auth.Signer().sign(parse_secrets("x" * MIN_SECRET_CHARS), frames, "tcp://127.0.0.1:5000")
    assert inbox.admit([*frames, stranger]) is None
    assert series.auth_state().keyring.signing == SECRET.encode()


def test_moris_sockets_per_thread_are_capped(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.18+: MORI's ``_connect_threadsafe`` (a socket cache per thread) calls the series' cap after each new
    socket; the cap closes the thread's oldest past ``MAX_PEER_SOCKETS``. Before 0.5.18 the series caps nothing."""
    mori = workdir / "tree/sglang/srt/disaggregation/mori/conn.py"
    if not mori.exists() or "def _connect_threadsafe" not in mori.read_text():
        pytest.skip("MORI keeps no socket cache per thread on this release (its manager's _connect is used)")
    assert "            cache[endpoint] = sock\n            pd_side_channels.cap_thread_sockets(cache, endpoint)" in (
        mori.read_text())
    series = _load(workdir / "tree", monkeypatch, workdir / "secret")

    class Sock:
        closed = False

        def close(self, linger: int = 0) -> None:
            self.closed = True

    monkeypatch.setattr(series, "MAX_PEER_SOCKETS", 3)
    cache = {f"tcp://127.0.0.1:{port}": Sock() for port in range(1, 9)}
    first = dict(cache)
    series.cap_thread_sockets(cache, "tcp://127.0.0.1:8")
    assert sorted(cache) == [f"tcp://127.0.0.1:{port}" for port in (6, 7, 8)]
    assert [first[f"tcp://127.0.0.1:{port}"].closed for port in range(1, 9)] == [True] * 5 + [False] * 3
