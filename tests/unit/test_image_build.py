"""The docker-free image build (sglang_harden/testbed/image_build.py): the Dockerfile as Docker reads it, and
refusals of what it does not emulate. Building the real images and starting pairs from them:
tests/e2e/test_images_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_harden.testbed import image_build
from sglang_harden.testbed.image_build import ImageBuildError, parse, substitute

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_continuations_join_and_comment_lines_drop_as_docker_does() -> None:
    text = ("# syntax=docker/dockerfile:1\nARG BASE=img:1\nFROM ${BASE} AS builder\n"
            "RUN echo a; \\\n    # a comment inside the instruction\n    echo b\nENV X=/opt/x\n")
    dockerfile = parse(text)
    assert dockerfile.global_args == {"BASE": "img:1"}
    [stage] = dockerfile.stages
    assert (stage.base, stage.name) == ("${BASE}", "builder")
    assert [(i.keyword, i.text, i.line) for i in stage.instructions] == [
        ("RUN", "echo a;     echo b", 4), ("ENV", "X=/opt/x", 7)]


def test_substitution_of_both_forms() -> None:
    assert substitute("${A}/x/$B/${C}", {"A": "1", "B": "2"}) == "1/x/2/"
    with pytest.raises(ImageBuildError, match="only \\$NAME and"):
        substitute("${A:-default}", {})


@pytest.mark.parametrize("env", ["A=1 B=2", 'A="quoted"', "A 1"])
def test_env_forms_that_are_not_emulated_are_refused(env: str, tmp_path: Path) -> None:
    build = image_build._Build("0.5.19", tmp_path / "ctx", tmp_path / "root", {}, lambda _m: None)
    stage = parse(f"FROM x\nENV {env}\n").stages[0]
    with pytest.raises(ImageBuildError, match="only one unquoted 'ENV NAME=VALUE'"):
        build._run_stage(stage, {})


@pytest.mark.parametrize("text, message", [
    ("FROM a\nWORKDIR /x\n", "WORKDIR is not emulated"),
    ("RUN true\n", "before the first FROM"),
    ("FROM a b c d\n", "expected 'FROM IMAGE"),
    ("FROM a\nRUN echo \\\n", "ends inside a continued instruction"),
    ("# nothing\n", "no FROM"),
])
def test_what_is_not_emulated_is_refused(text: str, message: str) -> None:
    with pytest.raises(ImageBuildError, match=message):
        parse(text)


def test_both_deploy_dockerfiles_parse_with_their_stages() -> None:
    plugin = parse((DEPLOY / "Dockerfile.plugin").read_text())
    assert [stage.name for stage in plugin.stages] == [None]
    assert [i.keyword for i in plugin.stages[0].instructions] == ["RUN", "ENV", "RUN", "RUN"]
    patched = parse((DEPLOY / "Dockerfile.patched").read_text())
    assert [stage.name for stage in patched.stages] == ["builder", None]
    assert [i.keyword for i in patched.stages[1].instructions] == ["ARG", "COPY", "RUN"]


def test_a_run_mount_other_than_the_context_is_refused(tmp_path: Path) -> None:
    build = image_build._Build("0.5.19", tmp_path / "ctx", tmp_path / "root", {}, lambda _m: None)
    with pytest.raises(ImageBuildError, match="only a bind mount of the whole build context"):
        build._run("--mount=type=cache,target=/root/.cache true", {}, "line 1: RUN")
    with pytest.raises(ImageBuildError, match="flag --network=none is not emulated"):
        build._run("--network=none true", {}, "line 1: RUN")


def test_the_image_filesystem_paths_are_remapped_and_the_context_mounted(tmp_path: Path) -> None:
    build = image_build._Build("0.5.19", tmp_path / "ctx", tmp_path / "root", {}, lambda _m: None)
    assert build.remap("a /opt/x and /tmp/y, not /usr/z") == f"a {build.fs}/opt/x and {build.fs}/tmp/y, not /usr/z"
    assert build.remap("/var/tmp/c x/tmp/d") == "/var/tmp/c x/tmp/d"  # only paths that start there
    under_opt = image_build._Build("0.5.19", tmp_path, Path("/opt/ci/tmp/root"), {}, lambda _m: None)
    assert under_opt.remap("/tmp/a /opt/b") == "/opt/ci/tmp/root/fs/tmp/a /opt/ci/tmp/root/fs/opt/b"
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "w.whl").write_text("wheel")
    (build.fs / "tmp").mkdir(parents=True)
    build._run('--mount=type=bind,source=.,target=/tmp/dist cp /tmp/dist/w.whl "$OUT"',
               {"OUT": str(tmp_path / "out")}, "line 1: RUN")
    assert (tmp_path / "out").read_text() == "wheel"
    with pytest.raises(ImageBuildError, match=r"line 2: RUN exited 3:\nboom"):
        build._run("echo boom; exit 3", {}, "line 2: RUN")
