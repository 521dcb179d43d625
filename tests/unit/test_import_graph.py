"""sglang-harden's own modules import each other without a circle (issue 16), counting imports inside functions
too: a late import only hides a circle from the interpreter, not from a reader."""

from __future__ import annotations

import ast
from pathlib import Path

import sglang_harden

PACKAGE_ROOT = Path(sglang_harden.__file__).resolve().parent


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, package: str, known: set[str]) -> set[str]:
    found: set[str] = set()
    if isinstance(node, ast.Import):
        found |= {alias.name for alias in node.names if alias.name in known}
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            name = f"{base}.{alias.name}"
            found.add(name if name in known else base)
    return found & known


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    paths = {_module_name(p, root): p for p in root.rglob("*.py")}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_imported(n, package, known) for n in ast.walk(tree))) - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_finder_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_late_imports_count(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "one.py").write_text("from pkg import two\n")
    (package / "two.py").write_text("def f():\n    from pkg.one import x\n")
    assert circles(import_graph(package)) == [["pkg.one", "pkg.two"]]


def test_sglang_harden_has_no_import_circle() -> None:
    assert circles(import_graph()) == []


# What the guards may not reach, directly or through sglang-harden modules they import: SGLang, torch (and
# the kernels built on it), and any HTTP or socket code. A guard takes a view in and gives a decision out.
FORBIDDEN_FOR_GUARDS = {"sglang", "torch", "triton", "urllib", "http", "aiohttp", "requests", "socket",
                        "httpx", "zmq"}


def external_imports(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Per sglang-harden module: the top-level names of the outside modules it imports (anywhere in the file)."""
    out: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
        out[_module_name(path, root)] = names - {root.name}
    return out


def reached_from(graph: dict[str, set[str]], starts: set[str]) -> set[str]:
    seen, todo = set(starts), list(starts)
    while todo:
        for nxt in graph.get(todo.pop(), set()) - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def forbidden_for_guards(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    package = root.name
    graph, outside = import_graph(root), external_imports(root)
    guards = {name for name in graph if name.startswith(f"{package}.guards")}
    found = {name: outside[name] & FORBIDDEN_FOR_GUARDS for name in reached_from(graph, guards)}
    return {name: names for name, names in found.items() if names}


def test_finder_follows_a_guard_into_a_helper(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "guards").mkdir(parents=True)
    for init in (package / "__init__.py", package / "guards" / "__init__.py"):
        init.write_text("")
    (package / "guards" / "g.py").write_text("from pkg import helper\n")
    (package / "helper.py").write_text("def f():\n    import torch.distributed as dist\n")
    assert forbidden_for_guards(package) == {"pkg.helper": {"torch"}}


def test_guards_import_no_sglang_torch_or_http() -> None:
    assert forbidden_for_guards() == {}
