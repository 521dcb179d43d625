"""One virtual environment per supported SGLang pin, built from ``ci/pins.toml``.

Layout: ``$SGLANG_HARDEN_HOME/venvs/<pin>`` (default home ``~/.cache/sglang-harden``), outside the repository
so fresh clones and CI on the same machine reuse it. Built with uv in hardlink mode, so torch, triton and the
shared pure-Python dependencies take disk space once for all pins. CPU torch comes from a local wheel and a
constraint pins it for every install (PyPI's torch of the same version is a multi-GB CUDA build).

Two stamps live in each venv: the recipe hash (rebuild the heavy part only when the pin's recipe changes) and
the hash of this package's sources (reinstall the current checkout of sglang-harden, non-editable, only when
it changed), so the real wheel's ``.pth`` start-up hook and entry point are what run in tests.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE_STAMP = ".sglang-harden-recipe"
PACKAGE_STAMP = ".sglang-harden-package"
BYTECODE_STAMP = ".sglang-harden-bytecode"
Log = Callable[[str], None]


class EnvError(RuntimeError):
    """A pin's environment cannot be built or is not there."""


def _stderr(msg: str) -> None:
    print(f"[setup-envs] {msg}", file=sys.stderr, flush=True)


def harden_home() -> Path:
    return Path(os.environ.get("SGLANG_HARDEN_HOME") or Path.home() / ".cache" / "sglang-harden")


def pins_file() -> Path:
    override = os.environ.get("SGLANG_HARDEN_PINS_FILE")
    return Path(override) if override else REPO_ROOT / "ci" / "pins.toml"


@dataclass(frozen=True)
class PinRecipe:
    """Everything needed to build and run one pin's environment (``[common]`` merged with ``[pins.X]``)."""

    pin: str
    sglang: str
    python: str
    torch_requirement: str
    torch_find_links: tuple[str, ...]
    deps: tuple[str, ...]
    no_deps: tuple[str, ...] = ()
    test_deps: tuple[str, ...] = ()
    shims: tuple[str, ...] = ()
    transfer_backends: tuple[str, ...] = ("mooncake",)
    prefill_flags: tuple[str, ...] = ()
    decode_flags: tuple[str, ...] = ()
    server_env: dict[str, str] = field(default_factory=dict)
    incident: str = "leak"
    # Whether sglang-harden can authenticate this pin's PD control plane (the testbed then gives every hardened
    # server a secret file).
    control_plane_auth: bool = True

    def build_hash(self) -> str:
        """Hash of what determines the venv's contents (not shims/flags/env, which act at run time)."""
        keys = ("sglang", "python", "torch_requirement", "deps", "no_deps", "test_deps")
        payload = {k: asdict(self)[k] for k in keys}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _tuple(*parts: object) -> tuple[str, ...]:
    out: list[str] = []
    for part in parts:
        out.extend(str(x) for x in (part or []))  # type: ignore[union-attr]
    return tuple(out)


def load_pins(path: Path | None = None) -> dict[str, PinRecipe]:
    data = tomllib.loads((path or pins_file()).read_text())
    common, torch = data.get("common", {}), data["torch"]
    recipes: dict[str, PinRecipe] = {}
    for pin, spec in data["pins"].items():
        recipes[pin] = PinRecipe(
            pin=pin,
            sglang=spec.get("sglang", pin),
            python=str(spec.get("python", common.get("python", "3.11"))),
            torch_requirement=torch["requirement"],
            torch_find_links=_tuple(torch.get("find_links")),
            deps=_tuple(common.get("deps"), spec.get("deps")),
            no_deps=_tuple(common.get("no_deps"), spec.get("no_deps")),
            test_deps=_tuple(common.get("test_deps"), spec.get("test_deps")),
            shims=_tuple(common.get("shims"), spec.get("shims")),
            transfer_backends=_tuple(spec.get("transfer_backends", common.get("transfer_backends"))),
            prefill_flags=_tuple(spec.get("prefill_flags", common.get("prefill_flags"))),
            decode_flags=_tuple(spec.get("decode_flags", common.get("decode_flags"))),
            server_env={**common.get("server_env", {}), **spec.get("server_env", {})},
            incident=spec.get("incident", "leak"),
            control_plane_auth=bool(spec.get("control_plane_auth", True)),
        )
    return recipes


def ci_pins(path: Path | None = None) -> list[str]:
    return list(tomllib.loads((path or pins_file()).read_text())["ci"]["pins"])


def ci_profiles(path: Path | None = None) -> list[str]:
    """Testbed profiles the CI runs profile-parametrized e2e cases on (``[ci].profiles``; default: all)."""
    from sglang_harden.testbed.profiles import PROFILES

    return list(tomllib.loads((path or pins_file()).read_text())["ci"].get("profiles", list(PROFILES)))


def full_run_only(path: Path | None = None) -> list[str]:
    """E2E cases (``<test module file>::<case>``) CI leaves to the full run (``[ci].full_run_only``)."""
    return list(tomllib.loads((path or pins_file()).read_text())["ci"].get("full_run_only", []))


def plugin_pins(path: Path | None = None) -> list[str]:
    """The testbed's pins the plugin supports (a recipe may exist for a release only the backport series serves, such
    as 0.5.18): what an e2e case of the plugin's guards runs on."""
    from sglang_harden.compat.pins import SUPPORTED_PINS

    return [pin for pin in load_pins(path) if pin in SUPPORTED_PINS]


def all_pins(path: Path | None = None) -> list[str]:
    """Every pin, in build order (the CI pins first)."""
    data = tomllib.loads((path or pins_file()).read_text())
    order = [p for p in data["ci"].get("order", []) if p in data["pins"]]
    return order + [p for p in data["pins"] if p not in order]


def get_recipe(pin: str) -> PinRecipe:
    recipes = load_pins()
    if pin not in recipes:
        raise EnvError(f"unknown pin {pin!r}; supported: {', '.join(recipes)} (see {pins_file()})")
    return recipes[pin]


def venv_dir(pin: str) -> Path:
    return harden_home() / "venvs" / pin


def venv_python(pin: str) -> Path:
    return venv_dir(pin) / "bin" / "python"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def is_built(pin: str) -> bool:
    """True when the pin's heavy part is built from its current recipe."""
    recipe = get_recipe(pin)
    return venv_python(pin).exists() and _read(venv_dir(pin) / RECIPE_STAMP) == recipe.build_hash()


def require_env(pin: str) -> Path:
    """The pin's python, or an EnvError saying how to build it."""
    if not is_built(pin):
        raise EnvError(
            f"the environment for SGLang {pin} is missing or outdated at {venv_dir(pin)}; "
            f"build it with: bash scripts/setup_envs.sh {pin}"
        )
    return venv_python(pin)


# ---------------------------------------------------------------------------------------------- building


def _run(cmd: Sequence[str | os.PathLike[str]], log: Log, env: dict[str, str] | None = None) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    proc = subprocess.run([str(c) for c in cmd], env=env, text=True, capture_output=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise EnvError(f"command failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{tail}")


def _uv() -> str:
    uv = shutil.which("uv")
    if uv is None:
        raise EnvError("uv is not installed: pip install uv")
    return uv


def _check_disk(path: Path, need_gb: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(path).free / 2**30
    if free_gb < need_gb:
        raise EnvError(
            f"not enough disk at {path}: {free_gb:.1f} GiB free, a pin's environment needs about {need_gb:.0f} GiB "
            "(the first pin ~3 GiB; later pins share torch/triton through hardlinks). Free space or set "
            "SGLANG_HARDEN_HOME to a bigger disk."
        )


def find_cpu_torch_wheel(recipe: PinRecipe) -> Path:
    explicit = os.environ.get("SGLANG_HARDEN_TORCH_WHEEL")
    if explicit:
        if not Path(explicit).is_file():
            raise EnvError(f"SGLANG_HARDEN_TORCH_WHEEL={explicit} is not a file")
        return Path(explicit)
    version = recipe.torch_requirement.split("==", 1)[1]
    py = "cp" + recipe.python.replace(".", "")
    for folder in recipe.torch_find_links:
        hits = sorted(glob.glob(os.path.join(folder, f"torch-{version}-{py}-{py}-*linux*x86_64.whl")))
        if hits:
            return Path(hits[0])
    raise EnvError(
        f"no CPU torch wheel ({recipe.torch_requirement}, {py}) found in {list(recipe.torch_find_links)}. "
        "PyPI's torch of that version is a CUDA build and is refused on purpose. Put the CPU wheel in one of "
        "those folders or set SGLANG_HARDEN_TORCH_WHEEL=/path/to/torch-...+cpu-...whl"
    )


def ensure_system_libs(log: Log) -> None:
    """Mooncake's wheel links libibverbs even for TCP; install it when missing and we are root."""
    probe = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    if "libibverbs.so.1" in probe.stdout:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        log("WARNING: libibverbs1 is missing (Mooncake needs it); install it: apt-get install -y libibverbs1")
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        _run(["apt-get", "install", "-y", "-q", "libibverbs1"], log, env)
    except EnvError:
        _run(["apt-get", "update", "-q"], log, env)
        _run(["apt-get", "install", "-y", "-q", "libibverbs1"], log, env)


def _base_python(recipe: PinRecipe) -> str:
    if f"{sys.version_info.major}.{sys.version_info.minor}" == recipe.python:
        return sys.executable
    return shutil.which(f"python{recipe.python}") or recipe.python


def _uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("UV_HTTP_TIMEOUT", "300")
    env.pop("VIRTUAL_ENV", None)
    return env


def build_heavy(recipe: PinRecipe, log: Log) -> None:
    """(Re)create the venv: CPU torch + curated deps + --no-deps sglang (+ --no-deps extras)."""
    target = venv_dir(recipe.pin)
    wheel = find_cpu_torch_wheel(recipe)
    _check_disk(target.parent, float(os.environ.get("SGLANG_HARDEN_MIN_FREE_GB", "4")))
    if target.exists():
        log(f"removing outdated {target}")
        shutil.rmtree(target)
    uv, env, py = _uv(), _uv_env(), str(target / "bin" / "python")
    _run([uv, "venv", "--quiet", "--python", _base_python(recipe), target], log, env)
    constraints = target / "constraints.txt"
    constraints.write_text(f"{recipe.torch_requirement}\n")
    common = ["--python", py, "--link-mode", "hardlink", "--constraint", constraints]
    links = dict.fromkeys([*(Path(p) for p in recipe.torch_find_links if Path(p).is_dir()), wheel.parent])
    common += [arg for link in links for arg in ("--find-links", link)]
    _run([uv, "pip", "install", *common, wheel, *recipe.deps, *recipe.test_deps], log, env)
    _run([uv, "pip", "install", *common, "--no-deps", f"sglang=={recipe.sglang}", *recipe.no_deps], log, env)
    _verify_heavy(recipe, py, log)


def _verify_heavy(recipe: PinRecipe, py: str, log: Log) -> None:
    check = (
        "import importlib.metadata as m, torch; v = torch.__version__; "
        "assert '+cpu' in v, f'non-CPU torch {v} got in'; "
        f"assert m.version('sglang') == {recipe.sglang!r}, m.version('sglang'); print(v)"
    )
    _run([py, "-c", check], log)


def venv_site_packages(venv: Path) -> Path:
    """The site-packages folder of the virtual environment at ``venv``."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise FileNotFoundError(f"no site-packages under {venv}")
    return found[0]


def _site_packages(pin: str) -> Path:
    return venv_site_packages(venv_dir(pin))


def compile_bytecode(pin: str, log: Log, subdir: str | None = None) -> None:
    """Precompile the venv's modules once. uv does not write .pyc, and with PYTHONDONTWRITEBYTECODE=1 (set
    on these machines) every SGLang process, and each child it spawns, would recompile thousands of modules
    from source at every start: minutes per server on a busy 2-core box instead of seconds."""
    target = _site_packages(pin) / subdir if subdir else _site_packages(pin)
    log(f"SGLang {pin}: precompiling bytecode in {target}")
    cmd = [str(venv_python(pin)), "-m", "compileall", "-q", "-j", "0", str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:  # a few vendored files are not valid py3.11; the rest is compiled
        log(f"SGLang {pin}: compileall reported errors (ignored): {proc.stdout.strip().splitlines()[-1:]}")


def ensure_bytecode(pin: str, log: Log) -> None:
    stamp = venv_dir(pin) / BYTECODE_STAMP
    if _read(stamp) == get_recipe(pin).build_hash():
        return
    compile_bytecode(pin, log)
    stamp.write_text(get_recipe(pin).build_hash() + "\n")


def package_sources_hash(root: Path = REPO_ROOT) -> str:
    digest = hashlib.sha256()
    files = [
        root / "pyproject.toml",
        *sorted((root / "sglang_harden").rglob("*")),
        *sorted((root / "patches").rglob("*")),
    ]
    for path in files:
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _snapshot_sources(root: Path, dest: Path) -> None:
    """Copy what the wheel is built from (no caches, no stray build output)."""
    for name in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"):
        if (root / name).exists():
            shutil.copy2(root / name, dest / name)
    if not (dest / "README.md").exists():  # hatchling needs the readme named in pyproject
        (dest / "README.md").write_text("sglang-harden\n")
    shutil.copytree(
        root / "sglang_harden", dest / "sglang_harden", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    shutil.copytree(root / "patches", dest / "patches", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def install_package(pin: str, log: Log = _stderr, root: Path = REPO_ROOT, force: bool = False) -> bool:
    """Install the current checkout of sglang-harden (non-editable); returns False when already current."""
    stamp = venv_dir(pin) / PACKAGE_STAMP
    wanted = package_sources_hash(root)
    if not force and _read(stamp) == wanted:
        return False
    with tempfile.TemporaryDirectory(prefix="sglang-harden-src-") as tmp:
        _snapshot_sources(root, Path(tmp))
        _run([_uv(), "pip", "install", "--python", venv_python(pin), "--no-deps", "--reinstall", tmp], log, _uv_env())
    compile_bytecode(pin, log, "sglang_harden")
    stamp.write_text(wanted + "\n")
    return True


def ensure_env(pin: str, log: Log = _stderr, force: bool = False) -> Path:
    """Build (if needed) the pin's venv and install the current checkout into it; returns its python."""
    recipe = get_recipe(pin)
    ensure_system_libs(log)
    if force or not is_built(pin):
        log(f"building the environment for SGLang {pin} at {venv_dir(pin)} (recipe {recipe.build_hash()})")
        (venv_dir(pin) / RECIPE_STAMP).unlink(missing_ok=True)
        build_heavy(recipe, log)
        (venv_dir(pin) / RECIPE_STAMP).write_text(recipe.build_hash() + "\n")
    else:
        log(f"SGLang {pin}: environment up to date ({venv_dir(pin)})")
    ensure_bytecode(pin, log)
    if install_package(pin, log):
        log(f"SGLang {pin}: installed the current sglang-harden checkout")
    return venv_python(pin)


def env_status(pin: str) -> dict[str, object]:
    recipe = get_recipe(pin)
    return {
        "pin": pin,
        "path": str(venv_dir(pin)),
        "built": is_built(pin),
        "recipe": recipe.build_hash(),
        "package_current": _read(venv_dir(pin) / PACKAGE_STAMP) == package_sources_hash(),
    }


def select_pins(args: Sequence[str]) -> list[str]:
    if not args or "--ci" in args:
        return ci_pins() + [a for a in args if a != "--ci" and a not in ci_pins()]
    if "--all" in args:
        return all_pins()
    return list(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="setup_envs.sh", description="One venv per SGLang pin (ci/pins.toml).")
    parser.add_argument("pins", nargs="*", help="pins to build; --ci (default) or --all")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    args, rest = parser.parse_known_args(argv)
    try:
        pins = select_pins([*args.pins, *rest])
        for pin in pins:
            get_recipe(pin)
        for pin in pins:
            ensure_env(pin, force=args.force)
    except EnvError as exc:
        _stderr(f"ERROR: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
