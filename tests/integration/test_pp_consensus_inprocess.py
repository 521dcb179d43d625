"""The PP consensus store's ZMQ socket (SGLang 0.5.22+, prefill with ``--pp-size`` > 1) under an attacker without the
secret: run under a pin venv that has ``sglang.srt.disaggregation.pp_consensus_store``.

PP rank 0 binds a PULL socket on the node's network-facing address; the other PP ranks replicate each room's transfer
status to it, and rank 0 decides a room by the statuses of every rank (``collect``). Two real ``PPConsensusStore``
objects (rank 0 and rank 1, one process, loopback: the store's address lookup is pointed at 127.0.0.1; the PP group's
broadcast is a stand-in, there is no torch.distributed here) and a raw PUSH socket as the attacker. The same scenario
runs on SGLang's class as it is (vanilla), with the plugin's ``zmq_auth`` wrapper of ``_init_zmq`` (plugin), and
on the module as the pin's backport series patches it (patched: ``authenticate-side-channels``, the series' own
``pd_side_channels``, same secret): the forged "rank 1" status lands in vanilla's decision table and in neither
protected one, while rank 1's own replication still arrives (it signs). Fuzzed: ``SGLANG_HARDEN_WIRE_FUZZ_EXAMPLES``
(1,000 by default) unsigned messages of any frames, including well-formed replication ops, reach the plugin's rank 0
socket: none changes rank 0's table, its thread keeps running, every one is counted as refused.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("hypothesis")
pytest.importorskip("sglang")
try:
    import sglang.srt.disaggregation.pp_consensus_store as store_module
except ModuleNotFoundError:
    pytest.skip("this SGLang release has no PP consensus store (SGLang added it in 0.5.22)", allow_module_level=True)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sglang_harden import events  # noqa: E402
from sglang_harden.compat import zmq_channels  # noqa: E402
from sglang_harden.guards.bootstrap_auth import MIN_SECRET_CHARS  # noqa: E402
from sglang_harden.testbed.patched import copy_series_files  # noqa: E402
from sglang_harden.testbed.plugin_config import secret_in_force, write_secret  # noqa: E402
from sglang_harden.tools import patch as patch_tool  # noqa: E402

SECRET = "p" * MIN_SECRET_CHARS
WAIT_S = 10.0
OWN_ROOM, FORGED_ROOM, MARKER_ROOM = 101, 202, 303
SUCCESS, FAILED = 4, 0  # KVPoll values
EXAMPLES = int(os.environ.get("SGLANG_HARDEN_WIRE_FUZZ_EXAMPLES", "1000"))


class _Group:
    """The PP group's ``broadcast_object``: rank 0's store info, handed to every rank."""

    info: Any = None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if obj is not None:
            _Group.info = obj
        return _Group.info


@pytest.fixture
def secret(tmp_path: Path) -> Iterator[Path]:
    with secret_in_force(write_secret(tmp_path / "secret", SECRET)) as path:
        yield path


def _wait(condition: Any) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def _own_init(monkeypatch: pytest.MonkeyPatch, cls: Any, wrap: bool) -> None:
    """SGLang's own ``_init_zmq`` (without any hook an earlier test of this process installed), or it wrapped by the
    plugin's ``zmq_auth`` hook."""
    import inspect

    original = inspect.unwrap(cls._init_zmq)
    monkeypatch.setattr(cls, "_init_zmq", zmq_channels.guard_pp_store(original) if wrap else original)


def _patched_store(tmp: Path, secret: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Callable[[], int]]:
    """The pin's series applied to a copy of its files; its ``pd_auth``, ``pd_side_channels`` and the patched store
    module imported from there (the plugin's hooks play no part), and the series' refusal count."""
    import sglang
    import sglang.srt.disaggregation.common as common

    root = Path(sglang.__file__).resolve().parent.parent
    copy_series_files(sglang.__version__, root, tmp / "tree")
    report = patch_tool.apply_series(tmp / "tree", sglang.__version__)
    assert report.ok, report.message
    for name in ("SGLANG_HARDEN_ZMQ_AUTH", "SGLANG_HARDEN_ZMQ_SIGN", "SGLANG_HARDEN_SIDE_CHANNELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", str(secret))
    loaded = {}
    for name, package in (("pd_auth", common), ("pd_side_channels", common), ("pp_consensus_store", None)):
        full = f"{common.__name__}.{name}" if package is not None else store_module.__name__
        spec = importlib.util.spec_from_file_location(full, tmp / "tree" / (full.replace(".", "/") + ".py"))
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, full, module)
        if package is not None:
            monkeypatch.setattr(package, name, module, raising=False)
        spec.loader.exec_module(module)
        loaded[name] = module
    side = loaded["pd_side_channels"]
    return loaded["pp_consensus_store"], lambda: side.COUNTS[("zmq_auth", "reject")]


def _scenario(monkeypatch: pytest.MonkeyPatch, module: Any, rejected: Callable[[], int],
              wrap: bool = False) -> dict[str, Any]:
    cls = module.PPConsensusStore
    monkeypatch.setattr(module, "get_local_ip_auto", lambda *args: "127.0.0.1")
    _own_init(monkeypatch, cls, wrap)
    rank0 = cls(2, 0, _Group())
    rank1 = cls(2, 1, _Group())
    host, port = _Group.info
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.PUSH)
    attacker.connect(f"tcp://{host}:{port}")
    try:
        rank1[OWN_ROOM] = SUCCESS
        own_arrived = _wait(lambda: rank0.collect(OWN_ROOM)[1] == SUCCESS)
        forged = module._ReplicationOp(kind=int(module._OpKind.PUT), rank=1, key=FORGED_ROOM, value=FAILED)
        attacker.send(module._encoder.encode(forged))
        time.sleep(0.2)  # on another connection than rank 1's marker below: no order between them
        rank1[MARKER_ROOM] = SUCCESS
        _wait(lambda: rank0.collect(MARKER_ROOM)[1] == SUCCESS)
        forged_landed = _wait(lambda: rank0.collect(FORGED_ROOM)[1] == FAILED or rejected() > 0) and (
            rank0.collect(FORGED_ROOM)[1] == FAILED)
        return {"own_arrived": own_arrived, "forged_landed": forged_landed,
                "thread_alive": rank0._worker_thread.is_alive(), "rejected": rejected()}
    finally:
        attacker.close(linger=0)
        ctx.destroy(linger=0)
        for store in (rank1, rank0):  # SGLang's own shutdown: the worker threads close their sockets
            store.close()


def test_forged_pp_status_lands_on_vanilla_only(monkeypatch: pytest.MonkeyPatch, secret: Path,
                                               tmp_path: Path) -> None:
    plugin_rejected = lambda: events.snapshot().get("zmq_auth:reject", 0)  # noqa: E731
    with monkeypatch.context() as patch:
        vanilla = _scenario(patch, store_module, lambda: 0)
    with monkeypatch.context() as patch:
        plugin = _scenario(patch, store_module, plugin_rejected, wrap=True)
    with monkeypatch.context() as patch:
        patched = _scenario(patch, *_patched_store(tmp_path, secret, patch))
    assert vanilla["own_arrived"] and vanilla["forged_landed"], vanilla  # the harm: anyone votes as rank 1
    for name, run in (("plugin", plugin), ("patched", patched)):
        assert run["own_arrived"], (name, "rank 1's own (signed) replication did not arrive", run)
        assert not run["forged_landed"] and run["thread_alive"], (name, run)
        assert run["rejected"] >= 1, (name, run)


def test_the_hook_names_sglangs_method() -> None:
    hook = next(h for h in zmq_channels.HOOKS if h.qualname == "PPConsensusStore._init_zmq")
    assert hook.owner == "zmq_auth" and hasattr(store_module.PPConsensusStore, "_init_zmq")


def _ops() -> st.SearchStrategy[list[bytes]]:
    """What an attacker sends: SGLang's own encoding of plausible ops (any rank, kind, key, value), raw bytes, or
    either split over several frames."""
    op = st.builds(lambda kind, rank, key, value: store_module._encoder.encode(store_module._ReplicationOp(
        kind=kind, rank=rank, key=key, value=value)), st.integers(-2, 4), st.integers(-2, 4),
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=8)), st.one_of(st.none(), st.integers(-8, 8)))
    frame = st.one_of(op, st.binary(max_size=96))
    return st.lists(frame, min_size=1, max_size=3)


def test_unsigned_messages_never_reach_rank0s_table(monkeypatch: pytest.MonkeyPatch, secret: Path) -> None:
    cls = store_module.PPConsensusStore
    monkeypatch.setattr(store_module, "get_local_ip_auto", lambda *args: "127.0.0.1")
    _own_init(monkeypatch, cls, wrap=True)
    rank0, rank1 = cls(2, 0, _Group()), cls(2, 1, _Group())
    host, port = _Group.info
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.PUSH)
    attacker.connect(f"tcp://{host}:{port}")
    sent = [0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(frames=_ops())
    def one(frames: list[bytes]) -> None:
        attacker.send_multipart(frames)
        sent[0] += 1

    try:
        one()
        assert sent[0] >= EXAMPLES, ("Hypothesis ran fewer cases than asked", sent[0])
        assert _wait(lambda: events.snapshot().get("zmq_auth:reject", 0) >= sent[0]), events.snapshot()
        rank1[MARKER_ROOM] = SUCCESS  # behind them all on rank 0's socket: it still serves its own rank
        assert _wait(lambda: rank0.collect(MARKER_ROOM)[1] == SUCCESS)
        assert rank0._worker_thread.is_alive()
        assert rank0._peer_map == {1: {MARKER_ROOM: SUCCESS}}, rank0._peer_map
        assert events.snapshot().get("zmq_auth:reject", 0) == sent[0], (events.snapshot(), sent[0])
    finally:
        attacker.close(linger=0)
        ctx.destroy(linger=0)
        for store in (rank1, rank0):
            store.close()
