"""The backport series: each pin's series applies cleanly to that pin's own wheel source, ``verify`` recognises
the result, and ``apply`` refuses (without touching the tree) on a version mismatch, a reject or a partly
patched tree. Pristine sources come from ``sglang_harden.tools._wheels.release_tree``: the pin's venv, an unpacked
wheel under ``$SGLANG_HARDEN_HOME/wheel-src/<pin>``, or ``pip download --no-deps sglang==<pin>`` unpacked there.
Only the files a series touches (plus the version files) are copied per test, so this stays fast.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from sglang_harden.testbed.patched import copy_series_files
from sglang_harden.tools import patch as P
from sglang_harden.tools._wheels import ReleaseUnavailable, release_tree

PATCHES = P.default_patches_dir()
PINS = P.available_pins(PATCHES)

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch not installed")


def _pristine(pin: str) -> Path:
    try:
        root = release_tree(pin)
    except ReleaseUnavailable as exc:
        pytest.skip(f"no source for sglang=={pin} here and the download failed: {exc}")
    assert P.tree_version(root) == pin, f"{root} holds another release than {pin}"
    return root


def make_tree(pin: str, dest: Path) -> Path:
    """A minimal pristine tree: the files the series touches and the version files, copied from the pin."""
    return copy_series_files(pin, _pristine(pin), dest)


def patched_trees(factory: pytest.TempPathFactory, pins: tuple[str, ...]) -> dict[str, Path]:
    """Minimal trees of ``pins`` with their series applied (for tests that import a module the series adds)."""
    trees = {}
    for pin in pins:
        tree = make_tree(pin, factory.mktemp(pin))
        P.apply_series(tree, pin)
        trees[pin] = tree
    return trees


def load_series_module(path: Path, mode_env: str, mode: str | None, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A module the series adds, imported from its file with ``mode_env`` set to ``mode`` (None: unset)."""
    if mode is None:
        monkeypatch.delenv(mode_env, raising=False)
    else:
        monkeypatch.setenv(mode_env, mode)
    spec = importlib.util.spec_from_file_location(f"{path.stem}_under_test", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _digest(tree: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(tree.rglob("*")):
        if path.is_file() and ".git" not in path.relative_to(tree).parts:
            h.update(str(path.relative_to(tree)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    P.add_arguments(parser)
    args = parser.parse_args(list(argv))
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = P.run(args)
    return code, out.getvalue()


def test_every_expected_pin_has_a_series() -> None:
    assert {"0.4.9.post6", "0.5.19", "0.5.20", "0.5.21", "0.5.23"} <= set(PINS)


@pytest.mark.parametrize("pin", PINS)
def test_series_files_are_well_formed(pin: str) -> None:
    for patch in P.load_series(pin, PATCHES):
        text = patch.path.read_text()
        assert patch.summary.startswith("sglang-harden backport:"), patch.name
        assert "What:" in text and "Why:" in text, f"{patch.name}: header must say what and why"
        assert patch.targets and all(t.startswith("sglang/") for t in patch.targets)
        added = [line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
        imports = re.compile(r"^\s*(from|import)\s+sglang_harden\b|importlib\.import_module\(.sglang_harden")
        assert not any(imports.search(line) for line in added), f"{patch.name} imports the plugin"
        # (the digest board's routes, /sglang_harden/..., are the plugin's wire format, and so in the series too)


@pytest.mark.parametrize("pin", PINS)
def test_series_applies_to_its_pin_and_verify_recognises_it(pin: str, tmp_path: Path) -> None:
    tree = make_tree(pin, tmp_path)
    before = P.verify_series(tree, pin)
    assert not before.ok and not any(p["applied"] for p in before.patches)
    report = P.apply_series(tree, pin)
    assert [p["result"] for p in report.patches] == ["applied"] * len(report.patches)
    after = P.verify_series(tree, pin)
    assert after.ok, after.message
    for rel in {t for p in P.load_series(pin, PATCHES) for t in p.targets}:
        py_compile.compile(str(tree / rel), doraise=True)
    again = P.apply_series(tree, pin)
    assert again.message.startswith("already applied")


@pytest.mark.parametrize("pin", PINS)
def test_patch_tool_agrees_with_plain_patch_p1(pin: str, tmp_path: Path) -> None:
    """Operators may apply the series by hand: ``patch -p1 < NNNN-*.patch`` in series order gives the same tree."""
    by_tool, by_hand = make_tree(pin, tmp_path / "tool"), make_tree(pin, tmp_path / "hand")
    P.apply_series(by_tool, pin)
    for patch in P.load_series(pin, PATCHES):
        proc = subprocess.run(["patch", "-p1", "--batch", "--fuzz=0", "-i", str(patch.path)], cwd=by_hand,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _digest(by_tool) == _digest(by_hand)


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
@pytest.mark.parametrize("pin", PINS)
def test_series_applies_with_git_am(pin: str, tmp_path: Path) -> None:
    """Operators who keep SGLang in git take the series with ``git am``: one commit per patch, the patch's
    subject as the commit's, and the same tree as ``apply``."""
    by_tool, by_git = make_tree(pin, tmp_path / "tool"), make_tree(pin, tmp_path / "git" / "python")
    P.apply_series(by_tool, pin)
    repo = by_git.parent
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "pristine"]):
        subprocess.run(git + argv, cwd=repo, check=True, capture_output=True)
    series = P.load_series(pin, PATCHES)
    proc = subprocess.run(git + ["am", "-q", "--directory=python", *(str(p.path) for p in series)], cwd=repo,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = subprocess.run(git + ["log", "--reverse", "--format=%s"], cwd=repo, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert log == ["pristine", *(p.summary for p in series)]
    assert _digest(by_tool) == _digest(by_git)


def test_version_mismatch_is_refused_untouched(tmp_path: Path) -> None:
    tree = make_tree("0.5.20", tmp_path)
    digest = _digest(tree)
    with pytest.raises(P.PatchError) as info:
        P.apply_series(tree, "0.5.19")
    assert info.value.code == P.EXIT_VERSION and "0.5.20" in str(info.value)
    assert _digest(tree) == digest


def test_reject_leaves_the_tree_untouched(tmp_path: Path) -> None:
    """A late patch of the series cannot apply: nothing of the earlier patches may be left behind."""
    pin = "0.5.19"
    tree = make_tree(pin, tmp_path)
    series = P.load_series(pin, PATCHES)
    last = next(p for p in series if "authenticate-control-plane" in p.name)
    assert series.index(last) > 0  # earlier patches apply first, and must be undone
    target = tree / "sglang/srt/disaggregation/common/conn.py"
    text = target.read_text()
    assert text.count("\nlogger = logging.getLogger(__name__)\n") == 1
    target.write_text(text.replace("\nlogger = logging.getLogger(__name__)\n", "\nlogger = logging.getLogger('x')\n"))
    digest = _digest(tree)
    with pytest.raises(P.PatchError) as info:
        P.apply_series(tree, pin)
    assert info.value.code == P.EXIT_REJECT and last.name in str(info.value)
    assert _digest(tree) == digest


def test_partly_patched_tree_is_refused_and_reported(tmp_path: Path) -> None:
    pin = "0.5.19"
    tree = make_tree(pin, tmp_path)
    first = P.load_series(pin, PATCHES)[0]
    subprocess.run(["patch", "-p1", "--batch", "-s", "-i", str(first.path)], cwd=tree, check=True)
    report = P.verify_series(tree, pin)
    assert [p["applied"] for p in report.patches] == [True] + [False] * (len(report.patches) - 1)
    with pytest.raises(P.PatchError) as info:
        P.apply_series(tree, pin)
    assert info.value.code == P.EXIT_REJECT and "partly patched" in str(info.value)


def test_cli_exit_codes_and_json(tmp_path: Path) -> None:
    tree = make_tree("0.5.19", tmp_path)
    code, out = _cli("verify", "--tree", str(tree), "--json")
    assert code == P.EXIT_MISSING and json.loads(out)["ok"] is False
    code, out = _cli("apply", "--tree", str(tree))
    assert code == P.EXIT_OK, out
    code, out = _cli("verify", "--tree", str(tree), "--json")
    assert code == P.EXIT_OK and json.loads(out)["tree_version"] == "0.5.19"
    assert _cli("apply", "--tree", str(tree), "--pin", "0.5.23")[0] == P.EXIT_VERSION
    assert _cli("apply", "--tree", str(tmp_path / "nowhere"))[0] == P.EXIT_USAGE
    assert _cli("apply", "--pin", "0.5.19")[0] == P.EXIT_USAGE
    code, out = _cli("list", "--json")
    assert code == 0 and {e["pin"] for e in json.loads(out)["patches"]} == set(PINS)
    code, out = _cli("list", "--pin", "9.9.9")
    assert code == P.EXIT_USAGE and "no patch series" in out


# ---------------------------------------------------------------- the patched code itself (no SGLang import)


PATCHED_COMMON = "sglang/srt/disaggregation/common"


def _patched_tree(tmp_path: Path, pin: str = "0.5.19") -> Path:
    tree = make_tree(pin, tmp_path / "tree")
    P.apply_series(tree, pin)
    return tree


def _load_patched(tree: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A new module of the patched tree, imported from its file. Its ``from sglang.srt.disaggregation.common
    import pd_auth`` is served by empty package modules (SGLang is not installed here), put in sys.modules for
    this test only."""
    pd_auth = _load_patched(tree, "pd_auth", monkeypatch) if name != "pd_auth" else None
    packages = ["sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.disaggregation.common"]
    for package in packages:
        monkeypatch.setitem(sys.modules, package, ModuleType(package))
    sys.modules[packages[-1]].pd_auth = pd_auth  # type: ignore[attr-defined]
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", tree / PATCHED_COMMON / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", "SGLANG_HARDEN_BOOTSTRAP_AUTH",
                 "SGLANG_HARDEN_BOOTSTRAP_AUTH_MAX_AGE_S"):
        monkeypatch.delenv(name, raising=False)


def _load_pd_rejections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return _load_patched(_patched_tree(tmp_path), "pd_rejections", monkeypatch)


def test_rejection_board_is_bounded_expires_and_keeps_the_first_word(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      no_secret: None) -> None:
    mod = _load_pd_rejections(tmp_path, monkeypatch)
    board = mod.AbortBoard(capacity=2, ttl_s=3600)
    for room in (1, 2, 3):
        board.post(mod.PeerAbort(room, 400, f"m{room}", sent_kv=False))
    board.post(mod.PeerAbort(3, 500, "later retirement", sent_kv=True))
    assert mod.board_answer(board, [1, 2, 3]) == {"rooms": {
        "2": {"status_code": 400, "message": "m2", "sent_kv": False},
        "3": {"status_code": 400, "message": "m3", "sent_kv": False}}}
    stale = mod.AbortBoard(ttl_s=0.0)
    stale.post(mod.PeerAbort(7, 400, "x"))
    assert stale.lookup([7]) == []


def test_prefill_tokenizer_refusals_are_posted_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    no_secret: None) -> None:
    """The patched tokenizer's decorators post a refusal of a PD prefill's tokenizer on the board its bootstrap
    server serves (once, though validation runs inside tokenization), and nothing on decode, for a request without
    a room, or for anything but a refusal."""
    import asyncio

    mod = _load_pd_rejections(tmp_path, monkeypatch)

    class Manager:
        def __init__(self, mode: str) -> None:
            self.server_args = SimpleNamespace(disaggregation_mode=SimpleNamespace(value=mode))

        @mod.front_door_refusals
        def _validate_one_request(self, obj: Any, input_ids: list[int]) -> None:
            if len(input_ids) > 4:
                raise ValueError(f"The input ({len(input_ids)} tokens) is longer than the model's context length")
            if input_ids == [0]:
                raise KeyError("not a refusal")

        @mod.front_door_refusals_async
        async def _tokenize_one_request(self, obj: Any) -> str:
            self._validate_one_request(obj, obj.input_ids)
            return "tokenized"

    def tokenize(mode: str, room: Any, input_ids: list[int]) -> Any:
        obj = SimpleNamespace(bootstrap_room=room, input_ids=input_ids, rid="r")
        return asyncio.run(Manager(mode)._tokenize_one_request(obj))

    with pytest.raises(ValueError, match="context length"):
        tokenize("prefill", 41, list(range(9)))
    assert mod.board_answer(mod.BOARD, [41]) == {"rooms": {"41": {
        "status_code": 400, "message": "The input (9 tokens) is longer than the model's context length",
        "sent_kv": False}}}
    assert len(mod.BOARD.lookup([41])) == 1
    for mode, room in (("decode", 42), ("prefill", None), ("prefill", True)):
        with pytest.raises(ValueError):
            tokenize(mode, room, list(range(9)))
    with pytest.raises(KeyError):
        tokenize("prefill", 43, [0])
    assert tokenize("prefill", 44, [1, 2]) == "tokenized"
    assert mod.BOARD.lookup([42, 43, 44]) == []


def test_rejection_inputs_are_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_secret: None) -> None:
    mod = _load_pd_rejections(tmp_path, monkeypatch)
    assert mod.parse_notice(b'{"room": 5, "status_code": 400, "message": "too long"}') == mod.PeerAbort(
        5, 400, "too long", True)
    for bad in (b"[]", b'{"room": "5", "status_code": 400, "message": "m"}',
                b'{"room": 5, "status_code": 200, "message": "m"}',
                b'{"room": true, "status_code": 400, "message": ""}',
                b'{"room": 5, "status_code": 400, "message": "m", "sent_kv": "no"}', b"{" + b" " * 70000 + b"}"):
        with pytest.raises(ValueError):
            mod.parse_notice(bad)
    with pytest.raises(ValueError):
        mod.parse_rooms_query(",".join(str(i) for i in range(mod.MAX_ROOMS_PER_QUERY + 1)))


def test_patched_and_plugin_notices_are_one_wire_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       no_secret: None) -> None:
    """What a patched prefill posts and serves, a plugin decode reads (and the reverse), field for field,
    ``sent_kv`` included: the patched module's route, body and answer are the plugin's."""
    from sglang_harden.channels import abort_wire
    from sglang_harden.compat import notify

    mod = _load_pd_rejections(tmp_path, monkeypatch)
    assert mod.ROUTE == notify.ROUTE == "/pd_rejections"
    door = abort_wire.PeerAbort(11, 400, "Input length (300 tokens) exceeds the maximum allowed length", False)
    patched_board = mod.AbortBoard()
    patched_board.post(mod.parse_notice(abort_wire.notice_body(door)))  # plugin prefill -> patched board
    found, malformed = abort_wire.parse_board_answer(json.loads(json.dumps(mod.board_answer(patched_board, [11, 12]))))
    assert (found, malformed) == ([door], [])  # patched board -> plugin decode
    plugin_board = abort_wire.AbortBoard()
    plugin_board.post(abort_wire.parse_notice(mod.notice_body(mod.PeerAbort(12, 500, "aborted", True))))
    found, _ = mod.parse_board_answer(json.loads(json.dumps(notify.aborts_payload([12], plugin_board))))
    assert found == [mod.PeerAbort(12, 500, "aborted", True)]  # plugin board -> patched decode
    assert mod.rooms_target([1, 2]) == abort_wire.rooms_target([1, 2]) == "/pd_rejections?rooms=1,2"


def test_abort_verdict_reads_both_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_secret: None) -> None:
    mod = _load_pd_rejections(tmp_path, monkeypatch)

    class FINISH_ABORT:  # noqa: N801 - same name as SGLang's class, which is what the module checks
        def __init__(self, message: str, status_code: int | None) -> None:
            self.message, self.status_code = message, status_code

    class Req:
        to_finish = FINISH_ABORT("Input length (300 tokens) exceeds", 400)
        finished_reason = None

    assert mod.abort_verdict(Req()) == (400, "Input length (300 tokens) exceeds")
    Req.finished_reason, Req.to_finish = FINISH_ABORT("aborted", None), None
    assert mod.abort_verdict(Req()) == (500, "aborted")


# ---------------------------------------------------------------- the patched control-plane authentication


def _secret_file(path: Path, *secrets_: str) -> Path:
    path.write_text("\n".join(secrets_) + "\n")
    path.chmod(0o600)
    return path


def _load_pd_auth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> ModuleType:
    for name, value in env.items():
        monkeypatch.setenv(f"SGLANG_HARDEN_BOOTSTRAP_{name.upper()}", value)
    return _load_patched(_patched_tree(tmp_path), "pd_auth", monkeypatch)


SECRET_A, SECRET_B = "a" * 16 + "0123456789abcdef", "b" * 16 + "fedcba9876543210"
AUTHORITY = "127.0.0.1:8998"


def _token(secret: str, method: str, target: str, body: bytes = b"", **kwargs: Any) -> str:
    from sglang_harden.guards import bootstrap_auth

    return bootstrap_auth.sign(bootstrap_auth.parse_secrets(secret), method, AUTHORITY, target, body, **kwargs)


def test_patched_auth_is_the_plugins_code() -> None:
    """The series' pd_auth bundles the plugin's token rules, secret file, server check and signing client (the
    logic exists once): no copy of them in patches/_source."""
    source = (PATCHES / "_source" / "pd_auth.py").read_text()
    for name in ("def parse_secrets", "def _mac", "class NonceCache", "def verify", "hmac.new", "class _Nonces"):
        assert name not in source, name
    assert "# <bundle sglang_harden/guards/base.py sglang_harden/guards/bootstrap_auth.py" in source


def test_patched_auth_speaks_the_plugins_wire_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     no_secret: None) -> None:
    """A token the patched tree signs passes the plugin's check, and the reverse: patched and plugin nodes of one
    deployment interoperate."""
    from sglang_harden.guards import bootstrap_auth

    pd_auth = _load_pd_auth(tmp_path, monkeypatch, secret_file=str(_secret_file(tmp_path / "s", SECRET_A)))
    keyring = bootstrap_auth.parse_secrets(SECRET_A)
    body = b'{"room": 7, "status_code": 400, "message": "m"}'
    ours = pd_auth.headers("PUT", AUTHORITY, "/pd_rejections", body)[bootstrap_auth.HEADER]
    assert ours.startswith("sgh2.")
    identity = bootstrap_auth.ServerIdentity(8998, frozenset({"127.0.0.1"}))
    verdict = bootstrap_auth.verify(keyring, bootstrap_auth.RequestHead("PUT", AUTHORITY, "/pd_rejections"), body,
                                    ours, bootstrap_auth.NonceCache(60), identity=identity)
    assert verdict.verdict.value == "allow", verdict.reason
    theirs = _token(SECRET_A, "GET", "/pd_rejections?rooms=7")
    assert pd_auth.AUTH.refusal("GET", AUTHORITY, "/pd_rejections?rooms=7", b"", theirs) is None
    assert pd_auth.HEADER == bootstrap_auth.HEADER and pd_auth.ANSWER_HEADER == bootstrap_auth.ANSWER_HEADER


def test_patched_auth_refuses_what_it_must(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_secret: None) -> None:
    pd_auth = _load_pd_auth(tmp_path, monkeypatch, secret_file=str(_secret_file(tmp_path / "s", SECRET_A)),
                            auth_max_age_s="30")
    auth = pd_auth.AUTH
    body = b'{"room": 1}'
    token = pd_auth.headers("PUT", AUTHORITY, "/route", body)[pd_auth.HEADER]
    assert "missing" in auth.refusal("PUT", AUTHORITY, "/route", body, None)
    assert "malformed" in auth.refusal("PUT", AUTHORITY, "/route", body, "sgh2.x.y.z.w")
    assert "does not match" in auth.refusal("GET", AUTHORITY, "/route", body, token)  # method changed
    assert "does not match" in auth.refusal("PUT", AUTHORITY, "/route?x=1", body, token)  # target changed
    assert "does not match" in auth.refusal("PUT", "127.0.0.2:8998", "/route", body, token)  # Host changed
    assert auth.refusal("PUT", AUTHORITY, "/route", body, token) is None
    assert "replayed" in auth.refusal("PUT", AUTHORITY, "/route", body, token)
    other_body = pd_auth.headers("PUT", AUTHORITY, "/route", body)[pd_auth.HEADER]
    assert "does not match its" in auth.refusal("PUT", AUTHORITY, "/route", b'{"room": 2}', other_body)
    assert "replayed" in auth.refusal("PUT", AUTHORITY, "/route", body, other_body), "spent before the body"
    stale = _token(SECRET_A, "PUT", "/route", body, now=time.time() - 31)
    assert "old" in auth.refusal("PUT", AUTHORITY, "/route", body, stale)
    wrong = _token(SECRET_B, "PUT", "/route", body)
    assert "does not match" in auth.refusal("PUT", AUTHORITY, "/route", body, wrong)
    for stamp in ("²", "1000²", "١٠٠٠"):  # issue 39: int("²") raised (a 500 at the server)
        assert "malformed" in auth.refusal("GET", AUTHORITY, "/route", b"", f"sgh1.{stamp}.{'a' * 32}.{'b' * 64}")
        assert "malformed" in auth.refusal("GET", AUTHORITY, "/route", b"",
                                           f"sgh2.{stamp}.{'a' * 32}.{'b' * 64}.{'c' * 64}")
    assert "ACCEPT_SGH1" in auth.refusal("GET", AUTHORITY, "/route", b"", f"sgh1.{int(time.time())}.{'a' * 32}."
                                         f"{'b' * 64}")


def test_patched_auth_serves_fresh_tokens_at_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     no_secret: None) -> None:
    """Issue 39: at the replay cache's cap every request was refused until the window passed."""
    pd_auth = _load_pd_auth(tmp_path, monkeypatch, secret_file=str(_secret_file(tmp_path / "s", SECRET_A)))
    auth = pd_auth.AUTH
    auth.nonces = pd_auth.NonceCache(auth.max_age_s, max_entries=3)
    now = int(time.time())
    old = [_token(SECRET_A, "GET", "/route", now=now - 2) for _ in range(3)]
    assert all(auth.refusal("GET", AUTHORITY, "/route", b"", token) is None for token in old)
    assert auth.refusal("GET", AUTHORITY, "/route", b"", _token(SECRET_A, "GET", "/route", now=now - 1)) is None
    assert all("older than the replay cache" in auth.refusal("GET", AUTHORITY, "/route", b"", token)
               for token in old), "forgotten nonces are never replayable"


def test_patched_auth_rotates_with_two_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               no_secret: None, caplog: pytest.LogCaptureFixture) -> None:
    """The file holds (signing, next); a change of the file is picked up without a restart; an edit that breaks it
    (too short, not UTF-8) keeps the last good secrets."""
    secret = _secret_file(tmp_path / "s", SECRET_A, SECRET_B)
    pd_auth = _load_pd_auth(tmp_path, monkeypatch, secret_file=str(secret))
    for key in (SECRET_A, SECRET_B):
        assert pd_auth.AUTH.refusal("GET", AUTHORITY, "/route", b"", _token(key, "GET", "/route")) is None, key
    _secret_file(secret, SECRET_B + "-and-more-characters")
    monkeypatch.setattr(pd_auth, "RELOAD_EVERY_S", 0.0)
    assert "does not match" in pd_auth.AUTH.refusal("GET", AUTHORITY, "/route", b"", _token(SECRET_A, "GET", "/route"))
    for broken in (b"short\n", b"\xff" * 40 + b"\n"):
        secret.write_bytes(broken)
        os.utime(secret, ns=(len(broken), len(broken)))
        with caplog.at_level("ERROR"):
            new = _token(SECRET_B + "-and-more-characters", "GET", "/route")
            assert pd_auth.AUTH.refusal("GET", AUTHORITY, "/route", b"", new) is None
        assert "keeping the last good secrets" in caplog.text


def test_patched_auth_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_secret: None,
                               caplog: pytest.LogCaptureFixture) -> None:
    """No secret: nothing signed, a WARNING. enforce without a secret, a short or non-UTF-8 secret, a bad mode,
    bad listed authorities: refuse to start."""
    tree = _patched_tree(tmp_path)
    with caplog.at_level("WARNING"):
        open_module = _load_patched(tree, "pd_auth", monkeypatch)
    assert open_module.AUTH is None and open_module.headers("GET", AUTHORITY, "/route", b"") == {}
    assert "UNAUTHENTICATED" in caplog.text
    fake_requests = ModuleType("requests")
    assert open_module.signing(fake_requests) is fake_requests
    not_utf8 = tmp_path / "binary"
    not_utf8.write_bytes(b"\xff" * 40)
    ok = str(_secret_file(tmp_path / "ok", SECRET_A))
    for env, expected in ((("AUTH", "enforce"),), "needs a secret"), \
            ((("SECRET_FILE", str(_secret_file(tmp_path / "short", "x" * 31))),), "at least 32"), \
            ((("SECRET_FILE", str(not_utf8)),), "not UTF-8"), \
            ((("SECRET_FILE", str(tmp_path / "missing")),), "does not exist"), \
            ((("AUTH", "sometimes"), ("SECRET_FILE", ok)), "expected one"), \
            ((("AUTHORITIES", "prefill.svc"), ("SECRET_FILE", ok)), "host:port"), \
            ((("AUTH_ACCEPT_SGH1", "maybe"), ("SECRET_FILE", ok)), "expected 1 or 0"):
        with monkeypatch.context() as scoped:
            for name, value in env:
                scoped.setenv(f"SGLANG_HARDEN_BOOTSTRAP_{name}", value)
            with pytest.raises(RuntimeError, match=expected) as info:
                _load_patched(tree, "pd_auth", scoped)
            assert SECRET_A not in str(info.value)
    monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_AUTH", "off")
    monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", ok)
    assert _load_patched(tree, "pd_auth", monkeypatch).AUTH is None


class _Board(BaseHTTPRequestHandler):
    """A bootstrap server's rejection board as a forger (or a server without the secret) answers: unsigned."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"rooms": {"3": {"status_code": 400, "message": "forged", "sent_kv": false}}}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = _answer  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


def _watcher(mod: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Any:
    """pd_rejections' decode watcher without its thread (``_query`` imports SGLang's KVPoll: a stand-in)."""
    import threading

    base_conn = ModuleType("sglang.srt.disaggregation.base.conn")
    base_conn.KVPoll = type("KVPoll", (), {"Failed": 0})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.disaggregation.base", ModuleType("sglang.srt.disaggregation.base"))
    monkeypatch.setitem(sys.modules, "sglang.srt.disaggregation.base.conn", base_conn)
    watcher = mod.RejectionWatcher.__new__(mod.RejectionWatcher)
    watcher._verdicts, watcher._lock = mod.OrderedDict(), threading.Lock()
    watcher._mgr = SimpleNamespace(record_failure=lambda *a: None, update_status=lambda *a: None)
    return watcher


def test_patched_rejection_clients_sign(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_secret: None) -> None:
    """pd_rejections' PUT and GET carry a token over exactly the authority and target they send, and use an answer
    signed for them."""
    from sglang_harden.guards import bootstrap_auth

    monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", str(_secret_file(tmp_path / "s", SECRET_A)))
    mod = _load_pd_rejections(tmp_path, monkeypatch)
    keyring, nonces = bootstrap_auth.parse_secrets(SECRET_A), bootstrap_auth.NonceCache(60)
    identity = bootstrap_auth.ServerIdentity(1, frozenset({"127.0.0.1"}))
    sent: list[Any] = []

    class Answer:
        status = 200

        def __init__(self, request: Any) -> None:
            token = bootstrap_auth.read_token(request.get_header(bootstrap_auth.HEADER.capitalize()))
            self.headers = {bootstrap_auth.ANSWER_HEADER: bootstrap_auth.sign_answer(keyring, token, 200, self.body)}

        body = b'{"rooms": {"4": {"status_code": 400, "message": "too long", "sent_kv": false}}}'

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def read(self, _limit: int) -> bytes:
            return self.body

    monkeypatch.setattr(mod.urllib.request, "urlopen", lambda request, timeout: sent.append(request) or Answer(request))
    watcher = _watcher(mod, monkeypatch)
    assert mod._put("http://127.0.0.1:1/pd_rejections", b'{"room": 3}')
    watcher._query("127.0.0.1:1", [3, 4])
    assert watcher.pop(4) == (400, "too long"), "a signed answer is used"
    put, get = sent
    assert get.full_url == "http://127.0.0.1:1/pd_rejections?rooms=3,4"
    for request, target, body in ((put, "/pd_rejections", b'{"room": 3}'), (get, "/pd_rejections?rooms=3,4", b"")):
        token = request.get_header(bootstrap_auth.HEADER.capitalize())
        head = bootstrap_auth.RequestHead(request.get_method(), "127.0.0.1:1", target)
        decision = bootstrap_auth.verify(keyring, head, body, token, nonces, identity=identity)
        assert decision.verdict.value == "allow", decision.reason


def test_patched_rejection_watcher_refuses_a_forged_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           no_secret: None) -> None:
    """Issue 39: decode believed any answer from the address it asked (a forged rejection aborts a request)."""
    from loopback_http import serving

    monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", str(_secret_file(tmp_path / "s", SECRET_A)))
    mod = _load_pd_rejections(tmp_path, monkeypatch)
    watcher = _watcher(mod, monkeypatch)
    with serving(_Board) as addr:
        watcher._query(addr, [3])
        assert not mod._put(f"http://{addr}/pd_rejections", b'{"room": 3}'), "an unsigned 200 is no success"
    assert watcher.pop(3) is None, "a forged rejection was believed"


def test_doctor_reads_the_patched_authentication(tmp_path: Path) -> None:
    """doctor on a patched tree: the backport's authentication is an opt-in protection, on only with a secret file
    (and not off); on a vanilla tree nothing authenticates, whatever the settings say."""
    from sglang_harden.tools import _protections as protections
    from sglang_harden.tools import doctor
    from sglang_harden.tools._source import SourceTree

    vanilla = SourceTree(make_tree("0.5.19", tmp_path / "vanilla"))
    assert protections.detect_bootstrap_auth(vanilla).status == protections.NO
    patched = SourceTree(_patched_tree(tmp_path))
    native = protections.detect_bootstrap_auth(patched)
    assert native.status == protections.OPT_IN and "pd_auth.protect" in native.evidence[0], native
    plugin_off = {"SGLANG_HARDEN_ACTIVATE": "0"}
    secret = {**plugin_off, "SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE": str(tmp_path / "secret")}
    cases = [(patched, plugin_off, "MISSING", "unauthenticated"),
             (patched, secret, "native (switched on)", "enforce"),
             (patched, {**secret, "SGLANG_HARDEN_BOOTSTRAP_AUTH": "log"}, "native (switched on)", "log"),
             (patched, {**secret, "SGLANG_HARDEN_BOOTSTRAP_AUTH": "off"}, "MISSING", "unauthenticated"),
             (vanilla, secret, "MISSING", "unauthenticated")]
    for tree, environ, verdict, auth in cases:
        data = doctor.report(tree, [], environ)
        row = next(p for p in data["protections"] if p["key"] == "bootstrap_auth")
        assert (row["verdict"], data["harden"]["control_plane_auth"]) == (verdict, auth), environ


@pytest.mark.parametrize("pin", PINS)
def test_doctor_sees_the_patched_notice_channel(pin: str, tmp_path: Path) -> None:
    """doctor on a patched tree reports decode as told of prefill's rejections (the series' ``/pd_rejections``
    routes and decode's watcher); on the vanilla tree it does not (it said "missing" on patched trees too). A vanilla
    tree may tell decode through a backend's own sender (0.5.18's MORI, whose file the side-channel patch touches),
    never through the series' channel."""
    from sglang_harden.tools import _protections as protections
    from sglang_harden.tools._source import SourceTree

    vanilla = protections.detect_decode_abort_notify(SourceTree(make_tree(pin, tmp_path / "vanilla")))
    assert not any("pd_rejections" in line for line in vanilla.evidence), vanilla
    assert vanilla.status != protections.YES or "mori" in vanilla.evidence[0], vanilla
    patched = SourceTree(make_tree(pin, tmp_path / "tree"))
    assert P.apply_series(patched.root, pin).ok
    native = protections.detect_decode_abort_notify(patched)
    assert native.status == protections.YES, native
    assert any("pd_rejections.add_routes" in line for line in native.evidence), native


# ---------------------------------------------------------------- the patched capacity gate (no SGLang import)


def _patched_methods(path: Path, class_name: str, names: set[str]) -> type:
    """A stand-in class holding exactly the named methods of ``class_name`` from a patched file (its property
    setter included), compiled from that file's own text."""
    import ast
    import logging
    import textwrap

    text = path.read_text()
    lines = text.splitlines()
    cls = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    chunks = []
    for func in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in names):
        first = min([d.lineno for d in func.decorator_list] + [func.lineno]) - 1
        chunks.append(textwrap.dedent("\n".join(lines[first:func.end_lineno])))
    source = "class Standin:\n" + textwrap.indent("\n\n".join(chunks), "    ") + "\n"
    namespace: dict[str, Any] = {"os": os, "logger": logging.getLogger("patched-under-test")}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - the patched file's own code
    return namespace["Standin"]


class _ModelConfig:
    def __init__(self, context_len: int) -> None:
        self.context_len = context_len


@pytest.mark.parametrize("pin", PINS)
def test_patched_capacity_gate_modes(pin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool holds 256 tokens, the context is 512 (max_req_input_len 250): enforce refuses, log and off start
    unchanged, clamp lowers the scheduler's context to 256 and the tokenizer manager's (advertised) to 256."""
    tree = make_tree(pin, tmp_path)
    P.apply_series(tree, pin)
    scheduler_cls = _patched_methods(tree / "sglang/srt/managers/scheduler.py", "Scheduler",
                                     {"_check_kv_pool_holds_context"})
    tokenizer_cls = _patched_methods(tree / "sglang/srt/managers/tokenizer_manager.py", "TokenizerManager",
                                     {"max_req_input_len"})

    def scheduler(mode: str | None) -> Any:
        if mode is None:
            monkeypatch.delenv("SGLANG_HARDEN_CAPACITY", raising=False)
        else:
            monkeypatch.setenv("SGLANG_HARDEN_CAPACITY", mode)
        node = scheduler_cls()
        node.model_config, node.max_total_num_tokens, node.max_req_input_len = _ModelConfig(512), 256, 250
        return node

    with pytest.raises(RuntimeError, match="KV pool too small .* SGLANG_HARDEN_CAPACITY=clamp lowers"):
        scheduler(None)._check_kv_pool_holds_context()
    for mode, context in (("log", 512), ("off", 512), ("clamp", 256)):
        node = scheduler(mode)
        node._check_kv_pool_holds_context()
        assert node.model_config.context_len == context, mode
        manager = tokenizer_cls()
        manager.model_config, manager.context_len = _ModelConfig(512), 512
        manager.max_req_input_len = None
        manager.max_req_input_len = 250
        assert manager.max_req_input_len == 250
        assert (manager.context_len, manager.model_config.context_len) == (context, context), mode


def _load_generator(monkeypatch: pytest.MonkeyPatch) -> Any:
    source_dir = PATCHES / "_source"
    monkeypatch.syspath_prepend(str(source_dir))
    spec = importlib.util.spec_from_file_location("patch_gen_under_test", source_dir / "gen.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return gen


def test_generator_without_a_source_tree_refuses_and_keeps_the_series(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Run without ``$SGLANG_SRC``, the generator deleted ``patches/<pin>/`` first and then failed on the
    missing tree; now it refuses before writing anything."""
    gen = _load_generator(monkeypatch)
    kept = tmp_path / "out" / "0.5.19" / "series"
    kept.parent.mkdir(parents=True)
    kept.write_text("the committed series\n")
    with pytest.raises(SystemExit, match="no pristine SGLang 0.5.19 tree"):
        gen.main("0.5.19", tmp_path / "no-such-tree", tmp_path / "out")
    assert kept.read_text() == "the committed series\n"


@pytest.mark.parametrize("pin", PINS)
def test_committed_series_is_what_the_sources_generate(pin: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``patches/<pin>`` is generated from ``patches/_source`` (the specs, the shared blocks, and the plugin's own
    ``signing_client.py``, which the authentication patch embeds). A hand edit of a .patch file, or a change to
    any source without regenerating, fails here: the plugin and the patches cannot drift apart."""
    gen = _load_generator(monkeypatch)
    gen.main(pin, _pristine(pin), tmp_path)
    generated = {p.name: p.read_text() for p in (tmp_path / pin).iterdir()}
    committed = {p.name: p.read_text() for p in (PATCHES / pin).iterdir()}
    assert sorted(generated) == sorted(committed)
    stale = [name for name in generated if generated[name] != committed[name]]
    assert not stale, f"regenerate with: python3 patches/_source/gen.py {pin}  (stale: {stale})"

