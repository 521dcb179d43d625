"""An image's Python layer built without Docker: the Dockerfile's own instructions, run on a CPU stand-in of the
official SGLang image (there is no Docker engine on the test machines).

The stand-in of ``FROM <official image of pin P>`` is a copy of the testbed's venv of P (CPU torch, SGLang P)
with sglang-harden taken out and pip put in, as the official images have it: hard links for everything but
``sglang/``, which is copied (a patch must not write through a link into the pin's venv).

What the emulation does with each instruction, and how it differs from a real build:
- ``ARG``/``FROM``/``ENV``/``RUN``/``COPY --from=STAGE`` are executed; any other instruction, flag or
  ``--mount`` type is refused (``ImageBuildError``) rather than skipped.
- ``RUN`` runs under ``/bin/sh -c`` with the stage's ARGs and ENVs in its environment and the stand-in's
  ``bin/`` first on ``PATH`` (``python3`` is the image's Python). A bind mount of the build context is the
  context folder itself. The testbed's import shims of the pin (``ci/pins.toml``; CPU necessities such as PyPI's
  torchvision beside a CPU torch) are on ``PYTHONPATH``, as in every testbed process, all but ``cuda_sim`` (the
  simulator lives in the checkout, and no build step runs a kernel); they do not make sglang-harden importable.
- The image's filesystem outside the venv is a folder per build: absolute paths under ``/tmp/`` and ``/opt/`` in
  the Dockerfile's ``RUN``, ``ENV``, ``ARG`` and ``COPY`` text point into it (two builds at once do not share
  ``/tmp``). Other absolute paths are this machine's: the build runs as this user, not in a container. This
  machine's ``SGLANG_HARDEN_*``, ``PIP_*`` and ``UV_*`` settings do not reach the steps (a real build never sees
  them); the rest of the environment does.
- Every stage's venv lives at the same path, as an image's SGLang does in each stage built from it: a finished
  stage is moved aside and the next one starts from a fresh stand-in; ``COPY --from`` reads the moved stage.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sglang_harden.testbed.envs import get_recipe, venv_dir, venv_site_packages
from sglang_harden.testbed.procenv import INTERPRETER_LEAKS, SHIMS_DIR

Log = Callable[[str], None]
REMAPPED_ROOTS = ("/tmp/", "/opt/")
_REMAPPED = re.compile(r"(?<![\w./-])/(tmp|opt)/")
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_UNEMULATED_VARIABLE = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*[:?+-]")
# Settings of this machine a real build never sees: ours and the package installers'
_HOST_ONLY_PREFIXES = ("SGLANG_HARDEN_", "PIP_", "UV_")
_SHIMS_NOT_IN_BUILDS = ("cuda_sim",)


class ImageBuildError(RuntimeError):
    """A Dockerfile step failed, or uses something the emulation does not do."""


@dataclass
class Instruction:
    keyword: str
    text: str
    line: int


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: list[Stage]


@dataclass
class ImageLayer:
    """The built image's filesystem folder, its Python and the ``ENV`` of its last stage (paths remapped)."""

    root: Path
    python: Path
    env: dict[str, str]

    @property
    def bin_dir(self) -> Path:
        return self.python.parent

    @property
    def site_packages(self) -> Path:
        return venv_site_packages(self.python.parent.parent)


def parse(text: str) -> Dockerfile:
    """Instructions of a Dockerfile: comment lines dropped, continuations joined as Docker joins them."""
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("#"):
            continue
        if not pending:
            start = number
        if raw.endswith("\\"):
            pending += raw[:-1]
            continue
        pending += raw
        if pending.strip():
            logical.append((start, pending.strip()))
        pending = ""
    if pending.strip():
        raise ImageBuildError(f"line {start}: the Dockerfile ends inside a continued instruction")
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for number, line in logical:
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise ImageBuildError(f"line {number}: FROM {rest!r}: expected 'FROM IMAGE [AS NAME]'")
            stages.append(Stage(words[0], words[2] if len(words) == 3 else None))
        elif keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default if "=" in rest else None
        elif not stages:
            raise ImageBuildError(f"line {number}: {keyword} before the first FROM")
        elif keyword in ("ARG", "ENV", "RUN", "COPY"):
            stages[-1].instructions.append(Instruction(keyword, rest, number))
        else:
            raise ImageBuildError(f"line {number}: {keyword} is not emulated (only ARG, FROM, ENV, RUN, COPY)")
    if not stages:
        raise ImageBuildError("no FROM in the Dockerfile")
    return Dockerfile(global_args, stages)


def substitute(value: str, variables: Mapping[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` as Docker expands them outside RUN (an unset name becomes empty); the forms with a
    default or an error (``${NAME:-x}``, ...) are refused."""
    if _UNEMULATED_VARIABLE.search(value):
        raise ImageBuildError(f"{value!r}: only $NAME and ${{NAME}} are emulated")
    return _VARIABLE.sub(lambda m: variables.get(m.group(1) or m.group(2), ""), value)


def official_image_stand_in(pin: str, venv: Path, log: Log) -> None:
    """The CPU stand-in of SGLang's official image of ``pin`` at ``venv`` (see the module docstring)."""
    source = venv_dir(pin)
    if source.stat().st_dev != venv.parent.stat().st_dev:
        raise ImageBuildError(f"the build folder {venv.parent} is on another filesystem than {source}: the stand-in "
                              "is made of hard links (build under the same disk, e.g. SGLANG_HARDEN_HOME's)")
    subprocess.run(["cp", "-al", str(source), str(venv)], check=True)
    site = venv_site_packages(venv)
    shutil.rmtree(site / "sglang")
    shutil.copytree(venv_site_packages(source) / "sglang", site / "sglang", symlinks=True, copy_function=_own_copy)
    python = venv / "bin" / "python"
    for command in (
        ["uv", "pip", "uninstall", "--quiet", "--python", str(python), "sglang-harden"],
        ["uv", "pip", "install", "--quiet", "--python", str(python), "pip"],
    ):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise ImageBuildError(f"preparing the stand-in of the {pin} image: {shlex.join(command)}: "
                                  f"{done.stdout}{done.stderr}")
    left = sorted(path.name for path in site.glob("sglang_harden*"))
    if left:
        raise ImageBuildError(f"sglang-harden left in the stand-in of the {pin} image: {left}")
    log(f"stand-in of the official {pin} image at {venv}")


def _own_copy(source: str, dest: str) -> None:
    """A copy the build may change; bytecode stays a link (Python replaces a .pyc, it never writes into one)."""
    if source.endswith(".pyc"):
        os.link(source, dest)
    else:
        shutil.copy2(source, dest)


def _replace_by_link(source: str, dest: str) -> None:
    """COPY's file, as a new link to the finished stage's (kept until the build folder goes; nothing writes a
    built file in place)."""
    if os.path.lexists(dest):
        os.unlink(dest)
    os.link(source, dest)


class _Build:
    def __init__(self, pin: str, context: Path, root: Path, build_args: Mapping[str, str], log: Log) -> None:
        self.pin, self.context, self.root, self.build_args, self.log = pin, context, root, build_args, log
        self.fs = root / "fs"
        self.venv = self.fs / "venv"
        self.stages_dir = root / "stages"
        self.finished: dict[str, Path] = {}

    def remap(self, text: str) -> str:
        """The Dockerfile's own text with its /tmp/ and /opt/ paths in this build's folder (before any
        substitution: a build argument is a path of this machine already)."""
        return _REMAPPED.sub(lambda m: f"{self.fs}/{m.group(1)}/", text)

    def run(self, dockerfile: Dockerfile) -> ImageLayer:
        global_scope = {name: self.build_args.get(name, default) for name, default in dockerfile.global_args.items()}
        env: dict[str, str] = {}
        for index, stage in enumerate(dockerfile.stages):
            if index:
                self._finish_stage(index - 1, dockerfile.stages[index - 1])
            base = substitute(stage.base, {k: v for k, v in global_scope.items() if v is not None})
            self.log(f"FROM {base}{f' AS {stage.name}' if stage.name else ''}")
            for prefix in REMAPPED_ROOTS:
                (self.fs / prefix.strip("/")).mkdir(parents=True, exist_ok=True)
            official_image_stand_in(self.pin, self.venv, self.log)
            env = self._run_stage(stage, global_scope)
        return ImageLayer(self.fs, self.venv / "bin" / "python", env)

    def _finish_stage(self, index: int, stage: Stage) -> None:
        kept = self.stages_dir / (stage.name or str(index))
        kept.parent.mkdir(parents=True, exist_ok=True)
        self.fs.rename(kept)
        self.finished[stage.name or str(index)] = kept

    def _run_stage(self, stage: Stage, global_scope: Mapping[str, str | None]) -> dict[str, str]:
        args: dict[str, str] = {}
        env: dict[str, str] = {}
        for instruction in stage.instructions:
            scope = {**args, **env}
            where = f"line {instruction.line}: {instruction.keyword}"
            if instruction.keyword == "ARG":
                name, _, default = instruction.text.partition("=")
                if name in self.build_args:  # a path of this machine already
                    args[name] = self.build_args[name]
                elif "=" in instruction.text:
                    args[name] = substitute(self.remap(default), scope)
                elif global_scope.get(name) is not None:
                    args[name] = str(global_scope[name])
            elif instruction.keyword == "ENV":
                name, sep, value = instruction.text.partition("=")
                if not sep or " " in name or " " in value or value[:1] in ("'", '"'):
                    raise ImageBuildError(f"{where}: only one unquoted 'ENV NAME=VALUE' is emulated")
                env[name] = substitute(self.remap(value), scope)
            elif instruction.keyword == "COPY":
                self._copy(instruction.text, scope, where)
            else:
                self._run(instruction.text, {**args, **env}, where)
        return env

    def _copy(self, text: str, scope: Mapping[str, str], where: str) -> None:
        words = substitute(self.remap(text), scope).split()
        if len(words) != 3 or not words[0].startswith("--from="):
            raise ImageBuildError(f"{where}: only 'COPY --from=STAGE SRC DEST' is emulated")
        stage, source, dest = words[0].removeprefix("--from="), words[1], words[2]
        if stage not in self.finished:
            raise ImageBuildError(f"{where}: no finished stage {stage!r}")
        fs = str(self.fs)
        if not (source.startswith(fs + "/") and dest.startswith(fs + "/")):
            raise ImageBuildError(f"{where}: {source} -> {dest} leaves the image's filesystem ({fs})")
        source_path = self.finished[stage] / os.path.relpath(source, fs)
        if source_path.is_dir():
            shutil.copytree(source_path, dest, symlinks=True, dirs_exist_ok=True, copy_function=_replace_by_link)
        else:
            _replace_by_link(str(source_path), dest)
        self.log(f"COPY --from={stage} {source_path} {dest}")

    def _run(self, text: str, variables: Mapping[str, str], where: str) -> None:
        command = self.remap(text)
        while command.startswith("--"):
            flag, _, command = command.partition(" ")
            command = command.lstrip()
            if not flag.startswith("--mount="):
                raise ImageBuildError(f"{where}: flag {flag} is not emulated")
            options = dict(part.partition("=")[::2] for part in flag.removeprefix("--mount=").split(","))
            if options.get("type") != "bind" or options.get("source", ".") != "." or "target" not in options:
                raise ImageBuildError(f"{where}: only a bind mount of the whole build context is emulated: {flag}")
            command = command.replace(options["target"], str(self.context))
        environment = {k: v for k, v in os.environ.items()
                       if k not in INTERPRETER_LEAKS and not k.startswith(_HOST_ONLY_PREFIXES)}
        environment.update(variables)
        environment["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{environment.get('PATH', '')}"
        environment["HOME"] = str(self.fs / "tmp" / "home")
        environment["PYTHONPATH"] = str(SHIMS_DIR)
        shims = [name for name in get_recipe(self.pin).shims if name not in _SHIMS_NOT_IN_BUILDS]
        environment["SGLANG_HARDEN_TESTBED_SHIMS"] = ",".join(shims)
        self.log(f"RUN {command[:160]}")
        done = subprocess.run(["/bin/sh", "-c", command], env=environment, capture_output=True, text=True,
                              cwd=self.fs)
        if done.returncode != 0:
            raise ImageBuildError(f"{where} exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def build(dockerfile: Path, pin: str, context: Path, root: Path, build_args: Mapping[str, str] | None = None,
          log: Log = lambda _msg: None) -> ImageLayer:
    """Build ``dockerfile``'s image for ``pin`` under ``root`` (a new folder) from ``context``; raises
    ``ImageBuildError`` naming the failing line. ``SGLANG_TREE`` and ``SGLANG_PIN`` default to the stand-in's."""
    root.mkdir(parents=True, exist_ok=False)
    tree = root / "fs" / "venv" / venv_site_packages(venv_dir(pin)).relative_to(venv_dir(pin))
    arguments = {"SGLANG_PIN": pin, "SGLANG_TREE": str(tree), **(build_args or {})}
    return _Build(pin, context, root, arguments, log).run(parse(dockerfile.read_text()))
