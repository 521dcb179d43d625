"""``sglang-harden compat sweep``'s static judgement, on small source trees written here (no SGLang needed)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.pins import release_key
from sglang_harden.tools import compat_sweep as sweep
from sglang_harden.tools._source import SourceTree


def _tree(root: Path, files: dict[str, str]) -> SourceTree:
    for rel, text in {"sglang/__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return SourceTree(root)


def _hook(qualname: str, params: tuple[str, ...], module: str = "sglang.srt.x", owner: str = "coverage") -> Hook:
    return Hook(owner, module, qualname, params, lambda f: f)


def test_a_hook_resolves_through_bases_and_imports(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {
        "sglang/srt/base.py": """
            class Base:
                def commit(self, decode_req, *args, **kwargs): ...
            def helper(req, error_message, status_code=None): ...
        """,
        "sglang/srt/x.py": """
            from sglang.srt.base import Base, helper
            class Queue(Base):
                pass
        """,
    })
    assert sweep.hook_problem(tree, _hook("Queue.commit", ("self", "decode_req"))) is None
    assert sweep.hook_problem(tree, _hook("helper", ("req", "error_message", "status_code"))) is None


@pytest.mark.parametrize(("qualname", "params", "problem"), [
    ("Queue.gone", ("self",), "sglang.srt.x.Queue.gone: not found"),
    ("Queue.commit", ("self", "req"), "parameters ('self', 'decode_req'), expected ('self', 'req') first"),
    ("Other.commit", ("self",), "sglang.srt.x.Other.commit: not found"),
])
def test_a_missing_or_moved_target_is_named(tmp_path: Path, qualname: str, params: tuple[str, ...],
                                            problem: str) -> None:
    tree = _tree(tmp_path, {"sglang/srt/x.py": "class Queue:\n    def commit(self, decode_req): ...\n"})
    found = sweep.hook_problem(tree, _hook(qualname, params))
    assert found is not None and problem in found
    assert sweep.hook_problem(tree, _hook("f", ("a",), module="sglang.srt.nowhere")) == (
        "sglang.srt.nowhere.f: module missing")


def test_a_guard_needs_every_core_hook_and_the_mooncake_ones(tmp_path: Path) -> None:
    mooncake, nixl = sweep.BACKEND_MODULES["mooncake"], sweep.BACKEND_MODULES["nixl"]
    tree = _tree(tmp_path, {
        "sglang/srt/x.py": "def core(a): ...\n",
        mooncake.replace(".", "/") + ".py": "class R:\n    def send(self, kv): ...\n",
        nixl.replace(".", "/") + ".py": "class R:\n    def other(self): ...\n",
    })
    hooks = [_hook("core", ("a",)), _hook("R.send", ("self", "kv"), module=mooncake),
             _hook("R.send", ("self", "kv"), module=nixl)]
    verdict = sweep.judge_guard(tree, "coverage", hooks)
    assert verdict.verdict == sweep.HOOKABLE and verdict.backends == ["mooncake"]
    assert verdict.lacking == ["nixl"], "a backend the release has, whose hooks do not resolve, is named"
    broken = sweep.judge_guard(tree, "coverage", [*hooks, _hook("gone", ("a",))])
    assert broken.verdict == sweep.NEEDS_PATCH and broken.missing == ["sglang.srt.x.gone: not found"]


def test_a_release_without_pd_disaggregation_is_impossible(tmp_path: Path) -> None:
    tree = _tree(tmp_path, {"sglang/srt/managers/scheduler.py": "class Scheduler: ...\n"})
    report = sweep.judge_release("0.3.0", tree, {})
    assert report.adapter is None and {v.verdict for v in report.guards.values()} == {sweep.IMPOSSIBLE}


def test_release_numbers_order_and_refuse_pre_releases() -> None:
    ordered = ["0.4.9", "0.4.9.post6", "0.4.10", "0.5.1", "0.5.10.post1", "0.5.23"]
    assert sorted(reversed(ordered), key=release_key) == ordered
    with pytest.raises(ValueError):
        release_key("0.5.0rc2")


def test_bad_input_is_refused_with_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_harden.cli import main

    assert main(["compat", "sweep", "--releases", "0.5.x"]) == 2
    assert "not a final SGLang release number" in capsys.readouterr().err


def test_a_release_not_here_is_reported_not_guessed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_harden.cli import main

    monkeypatch.setenv("SGLANG_HARDEN_HOME", str(tmp_path))
    assert main(["compat", "sweep", "--releases", "0.5.22", "--offline", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["release"] == "0.5.22" and "downloads are off" in report["error"] and report["adapter"] is None


def test_release_sources_download_with_a_pip_that_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """A testbed pin venv is built by uv and has no pip: the download must not depend on the running Python's."""
    import shutil
    import subprocess
    import sys

    from sglang_harden.tools import _wheels

    monkeypatch.setattr(sys, "executable", "/nonexistent/python-without-pip")
    command = _wheels.pip_command()
    assert command[0] != "/nonexistent/python-without-pip" and command[1:] == ["-m", "pip"]
    assert subprocess.run([*command, "--version"], capture_output=True, timeout=60).returncode == 0
    monkeypatch.setattr(sys, "_base_executable", "/nonexistent/base", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(_wheels, "subprocess", type("NoPip", (), {
        "run": staticmethod(lambda *a, **k: subprocess.CompletedProcess(a, 1)),
        "TimeoutExpired": subprocess.TimeoutExpired}))
    with pytest.raises(_wheels.ReleaseUnavailable, match="no pip here"):
        _wheels.pip_command()


def test_release_tree_is_unpacked_once_when_workers_ask_at_once(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two test workers on a fresh machine asked for the same release at once and raced on its unpacking (CI: a
    FileExistsError in the '.partial' folder); the release's lock makes one of them fetch and unpack it."""
    import threading
    import time
    import zipfile

    from sglang_harden.tools import _wheels

    monkeypatch.setenv("SGLANG_HARDEN_HOME", str(tmp_path / "home"))
    wheel = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for index in range(200):
            zf.writestr(f"sglang/srt/module_{index}.py", "x = 1\n")
    fetched: list[str] = []

    def download(version: str) -> Path:
        fetched.append(version)
        time.sleep(0.2)
        return wheel

    monkeypatch.setattr(_wheels, "_download", download)
    trees: list[Path] = []
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            trees.append(_wheels.release_tree("9.9.9"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=ask) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not errors, errors
    assert fetched == ["9.9.9"] and len(set(trees)) == 1 and len(trees) == 4
    assert len(list((trees[0] / "sglang" / "srt").glob("*.py"))) == 200


# ---------------------------------------------------------------- protection (compat.reach) per release

SERIES_PINS = ("0.4.9.post6", "0.4.10.post2", "0.5.10.post1", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22",
               "0.5.23")


def test_a_supported_pin_with_a_series_is_protected_by_both() -> None:
    assert sweep.protection_of("0.5.23", SERIES_PINS) == sweep.Protection("plugin + series")
    assert sweep.protection_of("0.5.23", ()) == sweep.Protection("plugin")
    assert sweep.protection_cell(sweep.protection_of("0.4.10.post2", SERIES_PINS)) == "plugin + series"


def test_a_series_only_pin_is_protected_by_its_series() -> None:
    protection = sweep.protection_of("0.5.18", SERIES_PINS)
    assert protection == sweep.Protection("series", None, None, "")
    assert sweep.protection_cell(protection) == "series"


def test_an_unprotected_release_names_the_nearest_protected_ones_and_the_next_step() -> None:
    protection = sweep.protection_of("0.5.11", SERIES_PINS)
    assert (protection.verdict, protection.older, protection.newer) == (
        "none", "0.5.10.post1 (series)", "0.5.18 (series)")
    assert protection.next_step.startswith("Nothing here protects SGLang 0.5.11")
    assert "older: 0.5.10.post1 (series); newer: 0.5.18 (series)" in protection.next_step
    assert sweep.protection_cell(protection) == "none → 0.5.10.post1 (series) / 0.5.18 (series)"
    first = sweep.protection_of(sweep.FIRST_PD_RELEASE, SERIES_PINS)
    assert sweep.protection_cell(first) == "none → - / 0.4.9.post6 (plugin + series)"


def test_the_default_range_starts_at_the_first_release_with_pd_disaggregation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from sglang_harden.tools import _wheels

    assert sweep.DEFAULT_FROM == sweep.FIRST_PD_RELEASE == "0.4.4.post2"
    monkeypatch.setattr(_wheels, "index_releases", lambda: ["0.4.4", "0.4.4.post1", "0.4.4.post2", "0.4.9.post5",
                                                            "0.4.9.post6", "0.5.23"])
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    assert sweep._choose_releases(parser.parse_args(["sweep"])) == ["0.4.4.post2", "0.4.9.post5", "0.4.9.post6",
                                                                    "0.5.23"]


def test_every_report_in_json_and_markdown_carries_its_protection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_harden.cli import main
    from sglang_harden.tools import _wheels

    patches = tmp_path / "patches"
    for pin in ("0.5.10.post1", "0.5.18", "0.5.23"):
        (patches / pin).mkdir(parents=True)
        (patches / pin / "series").write_text("")
    monkeypatch.setenv("SGLANG_HARDEN_PATCHES", str(patches))
    _tree(tmp_path / "tree", {"sglang/srt/managers/scheduler.py": "class Scheduler: ...\n"})
    monkeypatch.setattr(_wheels, "release_tree", lambda release, download=True: tmp_path / "tree")
    assert main(["compat", "sweep", "--releases", "0.5.23,0.5.11,0.5.18", "--json"]) == 0
    reports = {r["release"]: r["protection"] for r in json.loads(capsys.readouterr().out)}
    assert reports["0.5.23"] == {"verdict": "plugin + series", "older": None, "newer": None, "next_step": ""}
    assert reports["0.5.18"]["verdict"] == "series"
    assert (reports["0.5.11"]["verdict"], reports["0.5.11"]["older"], reports["0.5.11"]["newer"]) == (
        "none", "0.5.10.post1 (series)", "0.5.18 (series)")
    assert "compat sweep --releases 0.5.11" in reports["0.5.11"]["next_step"]

    assert main(["compat", "sweep", "--releases", "0.5.23,0.5.11,0.5.18", "--markdown"]) == 0
    markdown = capsys.readouterr().out.splitlines()
    assert markdown[0] == "# Support matrix (generated)"
    assert any(line.startswith("| release | e2e | protected by | adapter | startup |") for line in markdown)
    assert any(line.startswith("| 0.5.11 |  | none → 0.5.10.post1 (series) / 0.5.18 (series) | none |")
               for line in markdown)
    assert any(line.startswith("| 0.5.23 | yes | plugin + series | none |") for line in markdown)
    assert "Protection: 3 releases: 1 plugin + series, 1 series, 0 plugin, 1 none." in markdown
    assert any(line.startswith("- 0.5.11: Nothing here protects SGLang 0.5.11") for line in markdown)


def test_a_release_that_could_not_be_read_still_carries_its_protection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_harden.cli import main

    monkeypatch.setenv("SGLANG_HARDEN_HOME", str(tmp_path))
    assert main(["compat", "sweep", "--releases", "0.5.11", "--offline", "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["error"] and report["protection"]["verdict"] == "none"
    assert report["protection"]["newer"] == "0.5.18 (series)"
