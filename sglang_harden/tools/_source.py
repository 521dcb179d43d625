"""Read an SGLang source tree without importing it: modules as ASTs, functions by qualified name.

``doctor`` judges each protection from the code itself. Importing SGLang would need torch, a GPU stack and
seconds of start-up, and would run the code we are trying to judge; parsing needs nothing but the files, so it
works on an installed package, an unpacked wheel or a patched checkout alike.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

Func = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class FuncRef:
    """A function found in the tree: where it lives and its AST."""

    module: str
    qualname: str
    node: Func

    @property
    def cls(self) -> str | None:
        return self.qualname.rsplit(".", 1)[0] if "." in self.qualname else None

    @property
    def where(self) -> str:
        return f"{self.module}:{self.qualname} (line {self.node.lineno})"


class SourceTree:
    """An SGLang package on disk (the directory that contains ``sglang/``)."""

    def __init__(self, root: Path) -> None:
        root = Path(root)
        if root.name == "sglang" and (root / "__init__.py").exists():
            root = root.parent
        if not (root / "sglang").is_dir():
            raise FileNotFoundError(f"no sglang package under {root}")
        self.root = root
        self._modules: dict[str, ast.Module | None] = {}

    @classmethod
    def installed(cls) -> SourceTree | None:
        """The SGLang importable from this interpreter, found without executing it."""
        try:
            spec = importlib.util.find_spec("sglang")
        except (ImportError, ValueError):
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        return cls(Path(next(iter(spec.submodule_search_locations))).parent)

    def path(self, module: str) -> Path:
        base = self.root.joinpath(*module.split("."))
        package = base / "__init__.py"
        return package if package.exists() else base.with_suffix(".py")

    def exists(self, module: str) -> bool:
        return self.path(module).exists() or self.root.joinpath(*module.split(".")).is_dir()

    def module(self, module: str) -> ast.Module | None:
        if module not in self._modules:
            self._modules[module] = self._parse(self.path(module))
        return self._modules[module]

    @staticmethod
    def _parse(path: Path) -> ast.Module | None:
        try:
            return ast.parse(path.read_text(encoding="utf-8", errors="replace"), filename=str(path))
        except (OSError, SyntaxError, ValueError):
            return None

    def text(self, module: str) -> str:
        try:
            return self.path(module).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def submodules(self, package: str) -> list[str]:
        """Dotted names of the ``*.py`` modules directly or indirectly under ``package``."""
        base = self.root.joinpath(*package.split("."))
        if not base.is_dir():
            return []
        names = []
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(self.root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
        return names

    def version(self) -> str | None:
        for module in ("sglang._version", "sglang.version"):
            found = _string_assignment(self.module(module), ("__version__", "version"))
            if found:
                return found
        for meta in sorted(self.root.glob("sglang-*.dist-info/METADATA")):
            match = re.search(r"^Version:\s*(\S+)", meta.read_text(errors="replace"), re.M)
            if match:
                return match.group(1)
        return None

    def classes(self, module: str) -> dict[str, ast.ClassDef]:
        tree = self.module(module)
        if tree is None:
            return {}
        return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def function(self, module: str, qualname: str) -> FuncRef | None:
        """``Class.method`` or ``function`` in ``module``; methods are also looked up in base classes."""
        tree = self.module(module)
        if tree is None:
            return None
        if "." not in qualname:
            for node in tree.body:
                if isinstance(node, Func) and node.name == qualname:
                    return FuncRef(module, qualname, node)
            return None
        cls_name, method = qualname.split(".", 1)
        return self.method(module, cls_name, method)

    def method(self, module: str, cls_name: str, method: str, depth: int = 0) -> FuncRef | None:
        cls = self.classes(module).get(cls_name)
        if cls is None or depth > 6:
            return None
        for node in cls.body:
            if isinstance(node, Func) and node.name == method:
                return FuncRef(module, f"{cls_name}.{method}", node)
        for base in cls.bases:
            located = self.resolve_name(module, _base_name(base))
            if located is not None:
                found = self.method(located[0], located[1], method, depth + 1)
                if found is not None:
                    return found
        return None

    def resolve_name(self, module: str, name: str | None) -> tuple[str, str] | None:
        """Where a top-level ``name`` used in ``module`` is defined: (module, name), within this tree."""
        tree = self.module(module)
        if tree is None or not name:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                return module, name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name and node.module.startswith("sglang"):
                        return node.module, alias.name
        return None

    def callee(self, ref: FuncRef, call: ast.Call) -> FuncRef | None:
        """The function a call in ``ref`` reaches: ``self.m(...)`` or a plain name defined in the tree."""
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            if ref.cls is None:
                return None
            found = self.method(ref.module, ref.cls, func.attr)
            if found is None:
                found = self._mixin_method(ref.module, func.attr)
            return found
        if isinstance(func, ast.Name):
            located = self.resolve_name(ref.module, func.id)
            if located is not None:
                return self.function(*located)
        return None

    def _mixin_method(self, module: str, method: str) -> FuncRef | None:
        """``self`` in a scheduler mixin is the Scheduler: look for the method in any class of the module."""
        for cls_name in self.classes(module):
            found = self.method(module, cls_name, method)
            if found is not None:
                return found
        return None

    def reachable(self, ref: FuncRef, depth: int) -> Iterator[FuncRef]:
        """``ref`` and the functions it calls, to ``depth`` levels, each once."""
        seen: set[tuple[str, str]] = set()
        frontier = [ref]
        for level in range(depth + 1):
            next_frontier: list[FuncRef] = []
            for item in frontier:
                key = (item.module, item.qualname)
                if key in seen:
                    continue
                seen.add(key)
                yield item
                if level == depth:
                    continue
                for call in (n for n in ast.walk(item.node) if isinstance(n, ast.Call)):
                    target = self.callee(item, call)
                    if target is not None:
                        next_frontier.append(target)
            frontier = next_frontier


def _base_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _string_assignment(tree: ast.Module | None, names: tuple[str, ...]) -> str | None:
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            for target in _flatten_targets(targets):
                if target in names and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value.value
    return None


def _flatten_targets(targets: list[ast.expr]) -> Iterator[str]:
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, ast.Tuple | ast.List):
            yield from _flatten_targets(list(target.elts))


def attr_loads(node: ast.AST) -> set[str]:
    """Attribute names read (not written) anywhere under ``node``."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}


def identifiers(node: ast.AST) -> set[str]:
    """Every name, attribute and string constant under ``node``."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def calls(node: ast.AST) -> Iterator[ast.Call]:
    return (n for n in ast.walk(node) if isinstance(n, ast.Call))


def call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def exits_early(body: list[ast.stmt]) -> bool:
    """The block leaves the function or the loop iteration (return/continue/break/raise) at its top level."""
    return any(isinstance(s, ast.Return | ast.Continue | ast.Break | ast.Raise) for s in body)


def class_field_default(tree: ast.Module | None, field_name: str) -> tuple[bool, ast.expr | None]:
    """Whether a class in ``tree`` declares ``field_name`` (annotated or assigned), and its default."""
    if tree is None:
        return False, None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if stmt.target.id == field_name:
                        return True, stmt.value
                if isinstance(stmt, ast.Assign):
                    if field_name in set(_flatten_targets(stmt.targets)):
                        return True, stmt.value
    return False, None
