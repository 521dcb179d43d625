"""Several sglang-harden modules as one module of the backport series (a patched tree never imports sglang_harden).

``bundle(paths, provided)`` returns the modules' code in the order given, each as it is in sglang_harden except:

- the module docstring and every top-level import are dropped; the stdlib / numpy imports come back once, at the
  top of the bundle (but for names in ``provided``: a compatibility definition around the bundle);
- an import of another sglang_harden module must name something an earlier module of the bundle defines at top
  level (or one of ``provided``, defined by the text around the bundle); ``import x as y`` becomes ``y = x``;
  a module the bundle does not list but one of its modules imports from is bundled in before it;
- an import of a bundled module itself (``from sglang_harden.guards import zmq_auth [as za]``) becomes a namespace
  of that module's top-level names (``zmq_auth = SimpleNamespace(...)``), so ``zmq_auth.verify`` works as in
  the plugin;
- a top-level name two modules define (each guard's ``GUARD``) is renamed in the earlier one, where every use of
  it is that module's own;
- the plugin's logger (``logging.getLogger("sglang_harden")``) becomes the patched module's own.

So the guard logic a patched server runs is the plugin's, generated, never copied by hand.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "sglang_harden"
PLUGIN_LOGGER = 'logging.getLogger("sglang_harden")'  # a bundled module logs under the patched module's name
MODULE_LOGGER = "logging.getLogger(__name__)"


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _dropped_lines(tree: ast.Module) -> set[int]:
    """1-based line numbers of the docstring and the top-level imports."""
    dropped: set[int] = set()
    for index, node in enumerate(tree.body):
        docstring = index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if docstring or isinstance(node, (ast.Import, ast.ImportFrom)):
            dropped.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return dropped


def _rename(text: str, renames: dict[str, str]) -> str:
    """``text`` with each NAME token in ``renames`` replaced (not after a dot: attributes keep their names)."""
    if not renames:
        return text
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    out = []
    previous = None
    for tok in tokens:
        if tok.type == tokenize.NAME and tok.string in renames and previous != ".":
            tok = tok._replace(string=renames[tok.string])
        out.append(tok)
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            previous = tok.string
    return tokenize.untokenize(out)


def _external_imports(tree: ast.Module, provided: set[str]) -> list[str]:
    """The module's stdlib / numpy imports, one name a line, but for names the text around the bundle defines."""
    lines = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            lines.extend(f"import {a.name}" + (f" as {a.asname}" if a.asname else "") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__" and not _internal(node):
            for a in node.names:
                if a.name in provided:
                    continue
                lines.append(f"from {node.module} import {a.name}" + (f" as {a.asname}" if a.asname else ""))
    return lines


def _internal(node: ast.ImportFrom) -> bool:
    return (node.module or "").split(".")[0] == PACKAGE


def _module_file(dotted: str) -> str | None:
    """``sglang_harden.guards.zmq_auth`` -> ``sglang_harden/guards/zmq_auth.py`` (None: no such module file)."""
    rel = dotted.replace(".", "/") + ".py"
    return rel if (REPO / rel).is_file() else None


def _imported_modules(node: ast.ImportFrom) -> dict[str, str]:
    """The names an internal ``from X import a, b`` binds to whole modules (``from pkg import mod``): name -> file."""
    found = {}
    for a in node.names:
        rel = _module_file(f"{node.module}.{a.name}")
        if rel is not None:
            found[a.name] = rel
    return found


def _with_dependencies(paths: tuple[str, ...], provided: set[str]) -> tuple[str, ...]:
    """``paths`` and, before each, the sglang_harden modules it imports from that are not listed, where a name it
    imports is neither provided nor defined by a listed module (a re-exported name is found where it is defined)."""
    defined: set[str] = set()
    for rel in paths:
        defined |= _top_level_names(ast.parse((REPO / rel).read_text()))
    ordered: list[str] = []

    def visit(rel: str, stack: tuple[str, ...]) -> None:
        if rel in ordered:
            return
        if rel in stack:
            raise SystemExit(f"bundle: import cycle {' -> '.join((*stack, rel))}")
        for node in ast.parse((REPO / rel).read_text()).body:
            if not (isinstance(node, ast.ImportFrom) and _internal(node)):
                continue
            modules = _imported_modules(node)
            for a in node.names:
                if a.name in provided or (a.name not in modules and a.name in defined):
                    continue
                dep = modules.get(a.name) or _module_file(node.module or "")
                if dep is not None and dep not in paths and dep not in ordered:
                    defined.update(_top_level_names(ast.parse((REPO / dep).read_text())))
                    visit(dep, (*stack, rel))
        ordered.append(rel)

    for rel in paths:
        visit(rel, ())
    return tuple(ordered)


def _namespace(name: str, rel: str, tree: ast.Module, renames: dict[str, str]) -> str:
    """``name = SimpleNamespace(...)`` of the bundled module ``rel``'s top-level names (as renamed there)."""
    names = sorted(_top_level_names(tree))
    fields = ", ".join(f"{n}={renames.get(n, n)}" for n in names)
    return f"{name} = SimpleNamespace({fields})  # sglang-harden's {rel.removeprefix(PACKAGE + '/')}"


def bundle(paths: tuple[str, ...], provided: tuple[str, ...] = ()) -> str:
    paths = _with_dependencies(paths, set(provided))
    trees = {rel: ast.parse((REPO / rel).read_text()) for rel in paths}
    defined_later: dict[str, set[str]] = {}
    seen: set[str] = set()
    for rel in reversed(paths):
        defined_later[rel] = set(seen)
        seen |= _top_level_names(trees[rel])
    imports: list[str] = []
    parts: list[str] = []
    available = set(provided)
    renamed_in: dict[str, dict[str, str]] = {}
    for rel in paths:
        tree = trees[rel]
        text = (REPO / rel).read_text()
        aliases = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and _internal(node):
                modules = _imported_modules(node)
                for a in node.names:
                    if a.name in modules and modules[a.name] in renamed_in and a.name not in provided:
                        source = modules[a.name]
                        aliases.append(_namespace(a.asname or a.name, source, trees[source], renamed_in[source]))
                        if "from types import SimpleNamespace" not in imports:
                            imports.append("from types import SimpleNamespace")
                        continue
                    if a.name not in available:
                        raise SystemExit(f"bundle: {rel} imports {a.name} from {node.module}, which no earlier "
                                         "module of the bundle defines")
                    if a.asname and a.asname != a.name:
                        aliases.append(f"{a.asname} = {a.name}")
        imports += [line for line in _external_imports(tree, set(provided)) if line not in imports]
        mine = _top_level_names(tree)
        clashes = mine & defined_later[rel]
        renames = {name: f"_{Path(rel).stem}_{name.lstrip('_')}" for name in clashes}
        renamed_in[rel] = renames
        dropped = _dropped_lines(tree)
        kept = "".join(line for number, line in enumerate(text.splitlines(keepends=True), start=1)
                       if number not in dropped)
        body = _rename(kept, renames).strip("\n").replace(PLUGIN_LOGGER, MODULE_LOGGER)
        renamed = ", ".join(f"{a} as {b}" for a, b in renames.items())
        header = f"# ---- sglang-harden's {rel.removeprefix(PACKAGE + '/')}" + (f" ({renamed})" if renames else "")
        parts.append("\n".join([header, *aliases, "", body]))
        available |= mine - clashes
        available |= {alias.split(" = ")[0] for alias in aliases}
    return "\n".join(imports) + "\n\n\n" + "\n\n\n".join(parts) + "\n"
