"""The backport series: each pin's series applies cleanly to that pin's own wheel source, ``verify`` recognises
the result, and ``apply`` refuses (without touching the tree) on a version mismatch, a reject or a partly
patched tree. Pristine sources come from, in order: ``/tmp/src/<pin>``, ``$SGLANG_HARDEN_HOME/wheel-src/<pin>``,
the pin's venv, or ``pip download --no-deps sglang==<pin>`` unpacked into ``$SGLANG_HARDEN_HOME/wheel-src``.
Only the files a series touches (plus the version files) are copied per test, so this stays fast.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from sglang_harden.tools import patch as P

HOME = Path(os.environ.get("SGLANG_HARDEN_HOME") or Path.home() / ".cache" / "sglang-harden")
PATCHES = P.default_patches_dir()
PINS = P.available_pins(PATCHES)
VERSION_FILES = ("sglang/_version.py", "sglang/version.py")

pytestmark = pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch not installed")


def _pristine(pin: str) -> Path:
    candidates = [Path("/tmp/src") / pin, HOME / "wheel-src" / pin,
                  *sorted((HOME / "venvs" / pin).glob("lib/python3*/site-packages"))]
    for root in candidates:
        if (root / "sglang" / "srt").is_dir() and P.tree_version(root) == pin:
            return root
    return _download(pin, HOME / "wheel-src" / pin)


def _download(pin: str, dest: Path) -> Path:
    cache = HOME / "wheel-cache"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{pin}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"sglang=={pin}", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(cache.glob(f"sglang-{pin}-*.whl"))
        if proc.returncode != 0 or not wheels:
            pytest.skip(f"no source for sglang=={pin} here and the download failed: {proc.stderr[-300:]}")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheels[-1]) as zf:
        zf.extractall(tmp, [n for n in zf.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def make_tree(pin: str, dest: Path) -> Path:
    """A minimal pristine tree: the files the series touches and the version files, copied from the pin."""
    src = _pristine(pin)
    for rel in {*VERSION_FILES, *(t for p in P.load_series(pin, PATCHES) for t in p.targets)}:
        if (src / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / rel, dest / rel)
    return dest


def _digest(tree: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(tree.rglob("*")):
        if path.is_file():
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
        assert not any("sglang_harden" in line for line in added), f"{patch.name} imports the plugin"


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


def test_version_mismatch_is_refused_untouched(tmp_path: Path) -> None:
    tree = make_tree("0.5.20", tmp_path)
    digest = _digest(tree)
    with pytest.raises(P.PatchError) as info:
        P.apply_series(tree, "0.5.19")
    assert info.value.code == P.EXIT_VERSION and "0.5.20" in str(info.value)
    assert _digest(tree) == digest


def test_reject_leaves_the_tree_untouched(tmp_path: Path) -> None:
    """The last patch of the series cannot apply: nothing of the earlier patches may be left behind."""
    pin = "0.5.19"
    tree = make_tree(pin, tmp_path)
    last = P.load_series(pin, PATCHES)[-1]
    target = tree / last.targets[0]
    target.write_text(target.read_text().replace(") = self.tp_worker.get_worker_info()", ") = (None,) * 12"))
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


def _load_pd_rejections(tmp_path: Path) -> ModuleType:
    tree = make_tree("0.5.19", tmp_path)
    P.apply_series(tree, "0.5.19")
    path = tree / "sglang/srt/disaggregation/common/pd_rejections.py"
    spec = importlib.util.spec_from_file_location("pd_rejections_under_test", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rejection_board_is_bounded_and_expires(tmp_path: Path) -> None:
    mod = _load_pd_rejections(tmp_path)
    board = mod.RejectionBoard(capacity=2, ttl_s=3600)
    for room in (1, 2, 3):
        board.post(room, 400, f"m{room}")
    assert board.lookup([1, 2, 3]) == {"2": {"status_code": 400, "message": "m2"},
                                       "3": {"status_code": 400, "message": "m3"}}
    stale = mod.RejectionBoard(ttl_s=0.0)
    stale.post(7, 400, "x")
    assert stale.lookup([7]) == {}


def test_rejection_inputs_are_validated(tmp_path: Path) -> None:
    mod = _load_pd_rejections(tmp_path)
    assert mod.parse_post({"room": 5, "status_code": 400, "message": "too long"}) == (5, 400, "too long")
    for bad in ([], {"room": "5", "status_code": 400, "message": "m"}, {"room": 5, "status_code": 200, "message": "m"}):
        with pytest.raises(ValueError):
            mod.parse_post(bad)
    with pytest.raises(ValueError):
        mod.parse_rooms(",".join(str(i) for i in range(mod.MAX_ROOMS_PER_QUERY + 1)))


def test_abort_verdict_reads_both_fields(tmp_path: Path) -> None:
    mod = _load_pd_rejections(tmp_path)

    class FINISH_ABORT:  # noqa: N801 - same name as SGLang's class, which is what the module checks
        def __init__(self, message: str, status_code: int | None) -> None:
            self.message, self.status_code = message, status_code

    class Req:
        to_finish = FINISH_ABORT("Input length (300 tokens) exceeds", 400)
        finished_reason = None

    assert mod.abort_verdict(Req()) == (400, "Input length (300 tokens) exceeds")
    Req.finished_reason, Req.to_finish = FINISH_ABORT("aborted", None), None
    assert mod.abort_verdict(Req()) == (500, "aborted")
