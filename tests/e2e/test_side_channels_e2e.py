"""The ZMQ side channels of PD disaggregation under attack (issue 39): vanilla vs hardened, per pin and backend.

Every KV manager binds a ZMQ rank port: decode registers there where prefill writes a request's KV and sends each
room's transfer info and abort notices; prefill sends statuses and drain acks back. Vanilla SGLang trusts every
frame; the plugin signs every side-channel message (an HMAC auth frame under the deployment's secret, which every
hardened testbed server gets) and drops unsigned ones (``zmq_auth``, mode enforce), and starts a side-channel
listener again when it raises (``side_channels``).

One vanilla pair, one hardened pair (the plugin) and, where the pin's backport series has the
``authenticate-side-channels`` patch, one patched pair (a copy of the pin's SGLang with the series applied, the
plugin off) per case (``<pin>/<backend>``: the CI pins with Mooncake, and NIXL where ``ci/pins.toml`` lists it; on
Mooncake also a lone hardened decode without the secret, for what it reports), all with the test-only ``wiretap``
shim: the attacker (a process of its own under the pin's python,
``sglang_harden.testbed.zmq_attacker``, without the secret) finds the rank ports as a port scan would and clones
what a sniffer reads (``sglang_harden.testbed.side_channels``). Each test runs the same scenario
on every pair: the harm shows on vanilla, the plugin and the patched tree stop it (a test that ran the patched pair
records the patch path too; a patched tree logs its drops instead of counting them, so there the counts are lower
bounds). The scenarios that wreck vanilla come last (a
hijacked session stays hijacked, a dead listener stays dead):

1. forged drain ack: decode aborts a request while prefill's write into its pages is held back (test-only
   ``latewrite`` shim); the attacker sends ``ABORT_ACK`` for the room from each plausible rank (and, 0.5.22+,
   small generations and the one decode's abort carried). 0.5.23 vanilla (deferred release on by default)
   hands the pages back at once, while the write is still pending; hardened keeps them until prefill's real ack.
   vanilla before 0.5.21 (deferred release off by default) frees the pages at the abort itself, before any ack;
2. copy: the attacker registers its own Mooncake transfer engine (NIXL: its own NIXL agent, UCX on loopback)
   and adds it as a second destination of a live room (decode half sent first, the attacker acts once the tap
   shows decode's transfer info, then the prefill half). Vanilla writes the victim's KV into the attacker's zero
   buffer (in the runs so far also its aux, and it reported the room's status to the attacker), while the
   victim's output stays its own: the victim sees nothing. Hardened writes nothing there;
3. session hijack (Mooncake): a registration under the victim decode's session id with its KV pointers moved by
   half a page; vanilla writes the next request's KV off its pages and decode answers something else. NIXL keeps
   the first registration of an agent name (vanilla too): nothing to hijack, the case is skipped there;
4. malformed frames: one frame to each rank port (notes 3.3: ``[b"x"]`` kills prefill's listener on both
   backends, ``[b"AUX_DATA"]`` Mooncake decode's; NIXL 0.5.23's decode listener survives anything without
   staging); vanilla stops serving PD requests (its log shows the listener's traceback); hardened drops them, and
   its wire rules drop the same frames signed by a holder of the secret (a buggy peer).

Releases before 0.5.18 (``EARLY``: 0.4.9.post6, 0.4.10.post2, 0.5.10.post1) run vanilla and patched only (the plugin
supports no secret there, or not the release): SGLang has no abort notice or drain ack of its own, so the forged
acks are the page-lifecycle patch's ``SGH_ABORT_ACK`` (vanilla frees at the abort and is sent none: they would end
its listener, the last test's harm); their
series has no wire rules, so a signed malformed frame reaches the listener, which raises and is started again.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.client import GenResult, PairResult, generate, greedy_body, http_json, pd_generate
from sglang_harden.testbed.decisions import quarantined_pages_by_room
from sglang_harden.testbed.envs import get_recipe, require_env
from sglang_harden.testbed.incident import KVTRACE_ENV, tenant_a_prompt
from sglang_harden.testbed.latewrite import LATE_WRITE_ENV
from sglang_harden.testbed.latewrite_trace import await_send, late_writes, replayed, write_counts
from sglang_harden.testbed.patched import patched_env, patched_tree
from sglang_harden.testbed.pd_topology import PDPair, stop_together
from sglang_harden.testbed.procenv import testbed_env as _env_of
from sglang_harden.testbed.server import HARDENED_LAUNCHER, SECRET_FILE_ENV, VANILLA_LAUNCHER, Server, testbed_secret
from sglang_harden.testbed.side_channels import (
    OWN_ABORT,
    WIRETAP_ENV,
    Destination,
    Layout,
    Tap,
    copy_registration,
    copy_transfer_info,
    forged_drain_acks,
    hijack_registration,
    is_abort,
    is_registration,
    is_transfer_info,
    nixl_copy_registration,
    nixl_copy_transfer_info,
    pages_of,
    signed,
)
from sglang_harden.testbed.tools_cli import run_tool
from sglang_harden.testbed.zmq_attacker import Attacker
from sglang_harden.tools import matrix
from sglang_harden.tools.patch import default_patches_dir

pytestmark = pytest.mark.e2e

# the releases where the plugin or the backport series signs the side channels (_runs); CI runs its pins
# (ci/pins.toml), scripts/matrix.sh the rest
EARLY = ["0.4.9.post6", "0.4.10.post2", "0.5.10.post1"]
PINS = [*EARLY, "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
CASES = [f"{pin}/{backend}" for pin in PINS for backend in get_recipe(pin).transfer_backends]
KINDS = ("vanilla", "hardened", "patched")
PROTECTED = ("hardened", "patched")
# a patched tree logs its drops (no metrics there), at most once per 10 s per reason and message type, with the
# count since: what its log says so far is a lower bound (a drop within 10 s of one of the same kind shows later)
PATCHED_DROPS = r"sglang-harden: {guard} dropped (\d+) side-channel message"
SIZES = {"prefill_max_total_tokens": 600, "decode_max_total_tokens": 600, "context_length": 512}
PROMPT_LEN = 40
NEW_TOKENS = 12
# forged drain ack: prefill's write of this room waits for the trigger file (at most LATE_DELAY_S; the test touches
# the trigger after its check, so the bound only matters when the test dies: a loaded CI host once took 21 s
# between the send and the check, past an earlier 25 s bound)
DRAIN_ROOM = 7_390_000_001
LATE_DELAY_S = 90.0
# SGLang's deferred-release timeout (0.5.21+ default): a release sooner than this after the abort was an ack
DEFERRED_RELEASE_TIMEOUT_S = 30.0
ACK_SETTLE_S = 4.0  # how long the forged acks get to act (vanilla: one scheduler loop)
# vanilla decode without deferred release (none before 0.5.19, off by default until 0.5.21): an aborted request's
# pages go at once
FREES_AT_ONCE = (*EARLY, "0.5.18", "0.5.19", "0.5.20")
LISTENER_DEATH_S = 15.0  # a killed listener's traceback reaches the log within this
DEAD_REQUEST_TIMEOUT_S = 20.0  # the request after the kill: a served one takes a few seconds here
SETTLE_S = 1.0  # the attacker's frames reach the listener before the request that they target
# the victim's decode half waits while the attacker builds its destination: a NIXL agent's UCX set-up once took
# over two minutes on a loaded 2-core host (0.5.22, two modules side by side), past an earlier 120 s
COPY_REQUEST_TIMEOUT_S = 300.0
# what kills each listener on vanilla (notes 3.3); NIXL 0.5.23's decode listener is robust to anything without staging
PREFILL_KILLER = [b"x"]
DECODE_KILLER = {"mooncake": [b"AUX_DATA"], "nixl": [b"x"]}
PREFILL_LISTENERS = r"bootstrap_thread(?:_guarded)?"
DECODE_LISTENERS = {"mooncake": r"decode_thread", "nixl": r"decode_listener_thread"}


def _say(msg: str) -> None:
    print(f"[side-channels-e2e] {msg}", file=sys.stderr, flush=True)


@dataclass
class Side:
    """One pair of the case, its tap, the attacker aimed at it and the trace of its held write."""

    kind: str
    pair: PDPair
    tap: Tap
    attacker: Attacker
    trace: Path
    trigger: Path
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def hardened(self) -> bool:
        """The plugin's pair (its decisions on ``/server_info``)."""
        return self.kind == "hardened"

    @property
    def protected(self) -> bool:
        """The plugin's pair or the patched tree's (the pin's series, plugin off), both with the secret."""
        return self.kind in PROTECTED

    def port(self, role: str) -> str:
        return self.tap.endpoint(role)

    def rejected(self, server: Server, guard: str = "zmq_auth") -> int:
        """Side-channel messages the node dropped so far: unsigned ones (``zmq_auth``) or signed ones its wire rules
        refused (``side_channels``); 0 on vanilla; on a patched tree what its log said so far (PATCHED_DROPS)."""
        if self.kind == "patched":
            return sum(int(n) for n in re.findall(PATCHED_DROPS.format(guard=guard), server.log_text()))
        return int(server.harden_decisions().get(f"{guard}:reject", 0)) if self.hardened else 0

    def drops_since(self, server: Server, before: int) -> dict[str, int]:
        """A round's unsigned drops (``dropped``) and the node's total so far (``dropped_so_far``), one read."""
        so_far = self.rejected(server)
        return {"dropped": so_far - before, "dropped_so_far": so_far}


@dataclass
class Case:
    pin: str
    backend: str
    sides: dict[str, Side]
    without_secret: Server | None = None  # a hardened decode without the secret (Mooncake cases)

    def __iter__(self) -> Iterator[Side]:
        return iter(self.sides[kind] for kind in KINDS if kind in self.sides)

    def protected(self, seen: dict[str, Any]) -> Iterator[tuple[str, Any]]:
        """``(kind, round)`` of the plugin's pair and, where the pin's series has the patch, the patched tree's."""
        protected = [(kind, seen[kind]) for kind in PROTECTED if kind in seen]
        assert protected, f"{self.pin}: no protected pair ran (nothing here would be proven)"
        return iter(protected)


@pytest.fixture(scope="module", params=CASES)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    """``<pin>/<transfer backend>``; module-scoped: the case's two pairs serve all its tests."""
    require_pin(str(request.param))
    return str(request.param)


@pytest.fixture(scope="module")
def case(pin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    """The vanilla and the hardened pair (started together), each with an attacker, and on Mooncake a lone
    hardened decode without the secret (what it reports); all stopped at the end, also when a start fails."""
    version, backend = pin.split("/")
    root: Path = tmp_path_factory.mktemp(f"side-channels-{version}-{backend}")
    kinds = [kind for kind in KINDS if _runs(kind, version)]
    pairs = {kind: _pair(version, backend, kind, root / kind) for kind in kinds}
    lone = None
    if backend == "mooncake" and "hardened" in pairs:  # one per pin is enough: it does not depend on the backend
        lone = Server(version, "decode", max_total_tokens=SIZES["decode_max_total_tokens"],
                      context_length=SIZES["context_length"], transfer_backend=backend,
                      launcher_module=HARDENED_LAUNCHER, log_dir=root / "without-secret", name="decode-no-secret",
                      env={"SGLANG_HARDEN_ACTIVATE": "1", SECRET_FILE_ENV: ""})
    attackers: list[Attacker] = []
    started = time.monotonic()
    try:
        if lone is not None:
            lone.start()
        _start_together(list(pairs.values()))
        if lone is not None:
            lone.wait_ready()
        _say(f"{pin}: every pair ready in {time.monotonic() - started:.0f} s")
        sides = {}
        for kind, pair in pairs.items():
            attackers.append(Attacker(str(require_env(version)), env=_env_of(get_recipe(version))))
            sides[kind] = Side(kind, pair, Tap(root / kind / "tap"), attackers[-1], root / kind / "trace",
                               root / kind / "trace" / "land-now")
        yield Case(version, backend, sides, lone)
    finally:
        for attacker in attackers:
            attacker.close()
        try:
            stop_together([*(part for pair in pairs.values() for part in pair.parts()), *([lone] if lone else [])])
        finally:
            _say(f"{pin}: module case done in {time.monotonic() - started:.0f} s")


def _runs(kind: str, pin: str) -> bool:
    """Vanilla always; the plugin and the patched tree where the matrix says that path has ``zmq_auth`` on the pin
    (the plugin's adapter hooks it; the series has ``authenticate-side-channels``)."""
    if kind == "hardened":
        return "zmq_auth" in matrix.plugin_guards(pin)
    if kind == "patched":
        return "zmq_auth" in matrix.patch_guards(pin, default_patches_dir())
    return True


@pytest.fixture(autouse=True)
def _proves_what_ran(request: pytest.FixtureRequest, case: Case) -> None:
    """A proving test proves the path of each protected pair its case ran: the plugin's, the patched tree's or both
    (tests/conftest.py records the result for each)."""
    if request.node.get_closest_marker("proves"):
        paths = [path for kind, path in (("hardened", "plugin"), ("patched", "patch")) if kind in case.sides]
        request.node.user_properties.append(("proves_paths", paths))


def _pair(pin: str, backend: str, kind: str, log_dir: Path) -> PDPair:
    trace = log_dir / "trace"
    env = {WIRETAP_ENV: str(log_dir / "tap")}
    if kind == "hardened":
        env["SGLANG_HARDEN_ACTIVATE"] = "1"
    elif kind == "patched":  # the pin's series applied to a copy of its SGLang, the plugin off; the secret as ever
        env.update(patched_env(patched_tree(pin, log_dir / "tree")))
        if not get_recipe(pin).control_plane_auth:  # the testbed gives the plugin none there (0.4.x): the series one
            secret = log_dir / "pair.secret"
            secret.parent.mkdir(parents=True, exist_ok=True)
            secret.write_text(testbed_secret() + "\n")
            secret.chmod(0o600)
            env[SECRET_FILE_ENV] = str(secret)
    return PDPair(pin, transfer_backend=backend, **SIZES, env=env,
                  prefill_env={LATE_WRITE_ENV: f"{LATE_DELAY_S}:{DRAIN_ROOM}:trigger={trace / 'land-now'}",
                               KVTRACE_ENV: str(trace)},
                  launcher_module=HARDENED_LAUNCHER if kind == "hardened" else VANILLA_LAUNCHER,
                  log_dir=log_dir, progress=True)


def _start_together(pairs: list[PDPair]) -> None:
    errors: list[BaseException] = []

    def start(pair: PDPair) -> None:
        try:
            pair.start()
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(pair,)) for pair in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _body(seed: int, rid: str) -> dict[str, Any]:
    return greedy_body(tenant_a_prompt(seed, PROMPT_LEN), NEW_TOKENS, rid=rid)


def _booted(side: Side, body: dict[str, Any], room: int) -> dict[str, Any]:
    """``body`` with the bootstrap fields ``pd_generate`` adds (for sending the two halves separately)."""
    assert side.pair.prefill.bootstrap_port is not None
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": side.pair.prefill.bootstrap_port,
            "bootstrap_room": room}


def _served(result: PairResult) -> list[int]:
    assert result.prefill.ok and result.decode.ok, (result.prefill.summary(), result.decode.summary())
    assert result.decode.output_ids, result.decode.summary()
    return list(result.decode.output_ids)


def _full(numbers: dict[str, Any]) -> bool:
    return bool(numbers.get("full"))


def _pool_until(side: Side, want_full: bool, timeout: float) -> dict[str, Any]:
    """Decode's pool numbers once ``full`` is ``want_full``, or the last seen at ``timeout`` (prefill is asked
    too: an idle scheduler runs a loop when something asks it)."""
    deadline = time.monotonic() + timeout
    while True:
        side.pair.prefill.server_info()
        numbers = side.pair.decode.pool()
        if _full(numbers) == want_full or time.monotonic() > deadline:
            return numbers
        time.sleep(0.2)


# ----------------------------------------------------------------------------------------------- the tests


def _dropped(kind: str, round_: dict[str, Any], forged: int) -> bool:
    """The plugin counted every forged message of the round; a patched tree's log has said it dropped some (what
    it drops within 10 s of a drop of the same kind shows in its log only later, PATCHED_DROPS)."""
    if kind == "hardened":
        return bool(round_["dropped"] >= forged)
    return bool(round_["dropped_so_far"] >= 1)


def test_side_channel_auth_reported(case: Case) -> None:
    """What each node says of its side channels (``/server_info`` and ``sglang-harden audit``) and what a sniffer
    sees of them: hardened nodes with the secret report ``enforce`` and sign every message (decode's registration
    ends with the auth frame); vanilla reports nothing and signs nothing; a hardened node without the secret
    reports ``unauthenticated``, and audit flags it."""
    for side in case:
        for role, server in (("prefill", side.pair.prefill), ("decode", side.pair.decode)):
            state = server.harden_state()
            if side.hardened:
                assert state.get("side_channel_auth") == "enforce", state
                assert {"zmq_auth", "side_channels"} <= set(state.get("guards", [])), state
            elif side.kind == "patched":  # the series' block names the series and its authentication, no guards
                assert state.get("family") == "patched" and state.get("side_channel_auth") == "enforce", state
                assert "guards" not in state, state
            else:
                assert state == {}, state
            if side.kind == "patched":  # the series says it in its log too
                log = server.log_text()
                assert f"pd_side_channels: {role} {case.backend} rank port" in log, (role, log[-2000:])
                rules = "none on this release" if case.pin in EARLY else "enforce"
                assert f"ZMQ auth enforce, wire rules {rules}" in log, role
        _served(side.pair.generate(_body(1, f"hello-{side.kind}")))
        registration = side.tap.wait("decode", "prefill", is_registration, "registration")
        assert (registration.auth is not None) == side.protected, (side.kind, registration)
    if "hardened" not in case.sides:
        return
    hardened = case.sides["hardened"].pair
    code, audit = run_tool("audit", hardened.prefill.url, hardened.decode.url, "--timeout", "30")
    assert [node["side_channel_auth"] for node in audit["nodes"]] == ["enforce", "enforce"], audit
    assert "side_channels_unauthenticated" not in {f["code"] for f in audit["findings"]}, audit
    if case.without_secret is None:
        return
    state = case.without_secret.harden_state()
    assert state.get("side_channel_auth") == "unauthenticated", state
    assert "zmq_auth" not in state.get("guards", []), state
    code, audit = run_tool("audit", case.without_secret.url, "--timeout", "30")
    assert audit["nodes"][0]["side_channel_auth"] == "unauthenticated", audit
    assert "side_channels_unauthenticated" in {f["code"] for f in audit["findings"]}, audit
    assert code == 1, audit


@pytest.mark.proves("plugin", "zmq_auth", control="self")
def test_forged_drain_ack_does_not_release_held_pages(case: Case) -> None:
    """Decode aborts a request while prefill's write into its pages is held back; the attacker acks the drain."""
    seen = {side.kind: _drain_ack_round(side, case.pin in EARLY) for side in case}
    _say(f"{case.pin}/{case.backend} forged drain ack: {seen}")
    vanilla = seen["vanilla"]
    for kind, round_ in seen.items():
        assert round_["abort_status"] == 200, (kind, round_)
        assert not round_["written_at_acks"], (kind, "the held write landed before the check (scenario timing)", round_)
        assert round_["late_writes_attempted"] >= 1, (kind, "the held write was never replayed", round_)
        assert round_["final"]["full"], (kind, "decode's pool never came back after the write landed", round_)
    if case.pin in FREES_AT_ONCE:
        # vanilla before 0.5.21 has no deferred release on: decode frees an aborted request's pages at the abort
        # itself (the held write then lands in free pages), forged acks or not; there is nothing for them to release
        assert vanilla["after_acks"]["full"], vanilla
    else:
        assert not vanilla["before_acks"]["full"], ("vanilla did not hold the pages for the drain ack", vanilla)
        assert vanilla["after_acks"]["full"], ("vanilla kept the pages despite the forged acks", vanilla)
        assert vanilla["released_after_abort_s"] < DEFERRED_RELEASE_TIMEOUT_S, vanilla
    for kind, round_ in case.protected(seen):
        assert not round_["after_acks"]["full"], (kind, "released the pages at the forged acks", round_)
        assert _dropped(kind, round_, round_["forged_acks"]), (kind, "did not count the forged acks as dropped", round_)


def _drain_ack_round(side: Side, early: bool) -> dict[str, Any]:
    pair, rid = side.pair, f"drain-{side.kind}"
    assert pair.prefill.bootstrap_port is not None
    done: dict[str, PairResult] = {}
    sender = threading.Thread(target=lambda: done.update(r=pd_generate(
        pair.prefill.url, pair.decode.url, pair.prefill.bootstrap_port, _body(31, rid), room=DRAIN_ROOM,
        timeout=LATE_DELAY_S + 60)))
    sender.start()
    try:
        await_send(side.trace, DRAIN_ROOM, 90)  # prefill's write into the room's pages is now held back
        held_from = time.monotonic()
        abort_status, _ = http_json("POST", pair.decode.url + "/abort_request", {"rid": rid}, 30.0)
        aborted_at = time.monotonic()
        if side.kind == "vanilla" and early:
            # no abort notice, no drain ack, nothing held: the patch's acks would only kill this listener (a one-frame
            # kill of its own, the last test's), so none are sent
            abort_frames: tuple[bytes, ...] = (OWN_ABORT,)
        else:
            abort_frames = side.tap.wait("decode", "prefill", is_abort(DRAIN_ROOM), "abort notice", timeout=30).frames
        notice_after = time.monotonic() - aborted_at
        before = pair.decode.pool()
        acks = [] if side.kind == "vanilla" and early else forged_drain_acks(DRAIN_ROOM, abort_frames)
        dropped_before = side.rejected(pair.decode)
        for frames in acks:
            side.attacker.send(side.port("decode"), frames)
        # vanilla gives the pages back within a loop or two; hardened is watched for the whole window
        after = _pool_until(side, want_full=True, timeout=ACK_SETTLE_S)
        released_after = time.monotonic() - aborted_at
        held_for = time.monotonic() - held_from
        written = replayed(side.trace, DRAIN_ROOM)
        drops = side.drops_since(pair.decode, dropped_before)
        quarantined = quarantined_pages_by_room(pair.decode.log_text()).get(DRAIN_ROOM, 0)
    finally:
        side.trigger.parent.mkdir(parents=True, exist_ok=True)
        side.trigger.touch()  # the held write lands; prefill acks the drain once it did
        sender.join(LATE_DELAY_S + 90)
    deadline = time.monotonic() + 60
    while not replayed(side.trace, DRAIN_ROOM) and time.monotonic() < deadline:
        time.sleep(0.1)
    final = _pool_until(side, want_full=True, timeout=60)
    writes = write_counts(late_writes(side.trace), DRAIN_ROOM)
    return {"abort_status": abort_status, "abort_frames": len(abort_frames), "forged_acks": len(acks),
            "abort_notice_after_s": round(notice_after, 2), "write_held_at_check_s": round(held_for, 2),
            "before_acks": before, "after_acks": after, "released_after_abort_s": round(released_after, 2),
            "written_at_acks": written, **writes, **drops,
            "quarantined_pages": quarantined, "final": final,
            "decode_status": done["r"].decode.status if "r" in done else None}


@pytest.mark.proves("plugin", "zmq_auth", control="self")
def test_copy_destination_for_a_live_room(case: Case) -> None:
    """The attacker adds its own transfer engine (Mooncake) or NIXL agent as a second destination of a victim's
    room."""
    seen = {side.kind: _copy_round(side, case.backend) for side in case}
    _say(f"{case.pin}/{case.backend} copy: {seen}")
    vanilla = seen["vanilla"]
    for kind, round_ in seen.items():
        assert round_["victim"] == round_["reference"], (kind, "the victim's output is not its own", round_)
    assert vanilla["kv_bytes_at_attacker"] > 0, ("vanilla wrote nothing to the attacker's buffer", vanilla)
    for kind, round_ in case.protected(seen):
        assert round_["kv_bytes_at_attacker"] == 0 and round_["aux_bytes_at_attacker"] == 0, (kind, round_)
        assert round_["statuses_at_attacker"] == 0, (kind, round_)
        assert _dropped(kind, round_, 2), (kind, "did not count the forged messages as dropped", round_)


def _copy_round(side: Side, backend: str) -> dict[str, Any]:
    pair = side.pair
    reference = _served(pair.generate(_body(41, f"copy-reference-{side.kind}")))
    room = random.randrange(2**62)
    body = _booted(side, _body(41, f"copy-victim-{side.kind}"), room)
    decode_half: dict[str, GenResult] = {}
    waiting = threading.Thread(target=lambda: decode_half.update(r=generate(pair.decode.url, body,
                                                                            timeout=COPY_REQUEST_TIMEOUT_S)))
    waiting.start()
    try:
        info = side.tap.wait("decode", "prefill", is_transfer_info(room), "transfer info of the victim's room")
        registration = side.tap.wait("decode", "prefill", is_registration, "registration")
        layout, pages = Layout.of(registration.frames), pages_of(info.frames)
        status_port = int(side.attacker.ask(op="listen")["port"])
        size = Destination.size(layout, pages)
        if backend == "nixl":
            agent = side.attacker.ask(op="nixl", bytes=size)
            dest = Destination(agent["name"], int(agent["ptr"]), layout, pages)
            frames = [nixl_copy_registration(registration.frames, dest, bytes.fromhex(agent["metadata"]),
                                             status_port),
                      nixl_copy_transfer_info(info.frames, dest, status_port)]
        else:
            engine = side.attacker.ask(op="engine", bytes=size)
            dest = Destination(engine["session"], int(engine["ptr"]), layout, pages)
            frames = [copy_registration(registration.frames, dest, status_port),
                      copy_transfer_info(info.frames, dest, status_port)]
        dropped_before = side.rejected(pair.prefill)
        for message in frames:
            side.attacker.send(side.port("prefill"), message)
        time.sleep(SETTLE_S)
        prefill_half = generate(pair.prefill.url, body, timeout=COPY_REQUEST_TIMEOUT_S)
    finally:
        waiting.join(COPY_REQUEST_TIMEOUT_S + 30)
    assert prefill_half.ok and decode_half["r"].ok, (prefill_half.summary(), decode_half["r"].summary())
    time.sleep(SETTLE_S)  # the copy's last bytes land after the victim's own (a second destination)
    return {"reference": reference, "victim": decode_half["r"].output_ids, "pages": pages,
            "kv_bytes": dest.kv_bytes,
            "kv_bytes_at_attacker": side.attacker.ask(op="buffer", start=0, end=dest.kv_bytes)["nonzero_bytes"],
            "aux_bytes_at_attacker": side.attacker.ask(op="buffer", start=dest.kv_bytes)["nonzero_bytes"],
            "statuses_at_attacker": len(side.attacker.ask(op="inbox")["messages"]),
            **side.drops_since(pair.prefill, dropped_before)}


@pytest.mark.proves("plugin", "zmq_auth", control="self")
def test_session_hijack_moves_the_victims_kv(case: Case) -> None:
    """A registration under the victim decode's session id, its KV pointers half a page lower (inside the
    victim's own registered memory): prefill writes every later room of that session off its pages."""
    if case.backend != "mooncake":
        pytest.skip(f"{case.backend} keeps the first registration of an agent name (vanilla too): a registration "
                    "cannot replace a live decode's; the copy test covers a second destination there")
    seen = {side.kind: _hijack_round(side) for side in case}
    _say(f"{case.pin}/{case.backend} hijack: {seen}")
    vanilla = seen["vanilla"]
    assert vanilla["status"] == 200 and vanilla["after"] != vanilla["reference"], (
        "vanilla decode read its own KV after the hijack", vanilla)
    for kind, round_ in case.protected(seen):
        assert round_["status"] == 200 and round_["after"] == round_["reference"], (kind, round_)
        assert _dropped(kind, round_, 1), (kind, "did not count the forged registration as dropped", round_)


def _hijack_round(side: Side) -> dict[str, Any]:
    pair = side.pair
    reference = _served(pair.generate(_body(51, f"hijack-reference-{side.kind}")))
    registration = side.tap.wait("decode", "prefill", is_registration, "registration")
    dropped_before = side.rejected(pair.prefill)
    side.attacker.send(side.port("prefill"), hijack_registration(registration.frames, lambda item: -(item // 2)))
    time.sleep(SETTLE_S)
    after = pair.generate(_body(51, f"hijack-victim-{side.kind}"))
    return {"reference": reference, "after": after.decode.output_ids, "status": after.decode.status,
            "prefill_status": after.prefill.status, **side.drops_since(pair.prefill, dropped_before)}


@pytest.mark.proves("plugin", "zmq_auth", "side_channels", control="self")
def test_malformed_frames_do_not_stop_pd_serving(case: Case) -> None:
    """One malformed frame to each rank port. Vanilla's listener threads die (their tracebacks in the logs) and
    the next PD request is never served; hardened drops the unsigned frames (``zmq_auth``), and the same frames
    signed by a holder of the secret (a peer with a bug) are dropped by the wire rules (``side_channels``) before
    SGLang's listener reads them: it serves the next request as before. (The listener restart behind the wire rules
    is tested in process, tests/integration/test_zmq_channels_inprocess.py: no message found by the fuzzing passes
    the rules and raises in a listener.)"""
    seen = {side.kind: _malformed_round(side, case.backend) for side in case}
    _say(f"{case.pin}/{case.backend} malformed frames: {seen}")
    vanilla = seen["vanilla"]
    assert vanilla["died"]["prefill"], ("vanilla prefill's listener survived", vanilla)
    if case.backend == "mooncake":
        assert vanilla["died"]["decode"], ("vanilla decode's listener survived", vanilla)
    assert not vanilla["served_after"], ("vanilla still serves PD requests", vanilla)
    for kind, round_ in case.protected(seen):
        if kind == "hardened":
            assert round_["dropped"] == {"prefill": 1, "decode": 1}, round_
        else:  # a patched tree's log line counts every drop of the last 10 s (PATCHED_DROPS): at least this one
            assert round_["dropped"]["prefill"] >= 1 and round_["dropped"]["decode"] >= 1, (kind, round_)
        if case.pin in EARLY:  # no wire rules: the signed frame reaches the listener, which raises and restarts
            assert round_["restarted"] == {"prefill": True, "decode": True}, (kind, round_)
        else:
            assert round_["signed_dropped"] == {"prefill": 1, "decode": 1}, (kind, round_)
        assert not any(round_["died"].values()), (kind, round_)
        assert round_["served_after"] and round_["after"] == round_["reference"], (kind, round_)


def _log_since(server: Server, offset: int) -> str:
    return server.log_text()[offset:]


def _malformed_round(side: Side, backend: str) -> dict[str, Any]:
    pair = side.pair
    servers = {"prefill": pair.prefill, "decode": pair.decode}
    killers = {"prefill": PREFILL_KILLER, "decode": DECODE_KILLER[backend]}
    dead = {"prefill": re.compile(rf"Exception in thread .*\({PREFILL_LISTENERS}\)"),
            "decode": re.compile(rf"Exception in thread .*\({DECODE_LISTENERS[backend]}\)")}
    reference = _served(pair.generate(_body(61, f"malformed-reference-{side.kind}")))
    offsets = {role: len(server.log_text()) for role, server in servers.items()}
    dropped_before = {role: side.rejected(server) for role, server in servers.items()}
    for role in servers:  # the attacker: unsigned
        side.attacker.send(side.port(role), killers[role])
    killed = {"prefill", "decode"} if backend == "mooncake" else {"prefill"}  # what dies on vanilla
    deadline = time.monotonic() + LISTENER_DEATH_S
    died = {role: False for role in servers}
    while time.monotonic() < deadline and not all(died[role] for role in killed):
        died = {role: bool(dead[role].search(_log_since(server, offsets[role]))) for role, server in servers.items()}
        if side.protected and all(side.rejected(s) > dropped_before[r] for r, s in servers.items()):
            break
        time.sleep(0.25)
    dropped = {role: side.rejected(server) - dropped_before[role] for role, server in servers.items()}
    signed_before = {role: side.rejected(server, "side_channels") for role, server in servers.items()}
    if side.protected:  # a holder of the secret (a peer with a bug) sends the same frames, signed
        for role in servers:
            secret = servers[role].secret_file.read_text()
            side.attacker.send(side.port(role), signed(secret, killers[role], side.port(role)))
        deadline = time.monotonic() + LISTENER_DEATH_S
        while time.monotonic() < deadline and not all(
                side.rejected(s, "side_channels") > signed_before[r] or "started again" in _log_since(s, offsets[r])
                for r, s in servers.items()):
            time.sleep(0.25)
        died = {role: bool(dead[role].search(_log_since(server, offsets[role]))) for role, server in servers.items()}
    signed_dropped = {role: side.rejected(server, "side_channels") - signed_before[role]
                      for role, server in servers.items()}
    restarted = {role: "started again" in _log_since(server, offsets[role]) for role, server in servers.items()}
    after = pair.generate(_body(61, f"malformed-after-{side.kind}"),
                          timeout=120 if side.protected else DEAD_REQUEST_TIMEOUT_S)
    return {"reference": reference, "died": died, "dropped": dropped, "signed_dropped": signed_dropped,
            "restarted": restarted,
            "served_after": after.prefill.ok and after.decode.ok, "after": after.decode.output_ids,
            "after_status": (after.prefill.status, after.decode.status),
            "after_elapsed_s": round(after.decode.elapsed_s, 1)}
