"""Several sglang-harden modules as one module of the backport series (a patched tree never imports sglang_harden).

``bundle(paths, provided)`` returns the modules' code in the order given, each as it is in sglang_harden except:

- the module docstring and every top-level import are dropped; the stdlib / numpy imports come back once, at the
  top of the bundle (but for names in ``provided``: a compatibility definition around the bundle);
- an import of another sglang_harden module must name something an earlier module of the bundle defines at top
  level (or one of ``provided``, defined by the text around the bundle); ``import x as y`` becomes ``y = x``;
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
                if (a.asname or a.name) in provided:
                    continue
                lines.append(f"from {node.module} import {a.name}" + (f" as {a.asname}" if a.asname else ""))
    return lines


def _internal(node: ast.ImportFrom) -> bool:
    return (node.module or "").split(".")[0] == PACKAGE


def bundle(paths: tuple[str, ...], provided: tuple[str, ...] = ()) -> str:
    trees = {rel: ast.parse((REPO / rel).read_text()) for rel in paths}
    defined_later: dict[str, set[str]] = {}
    seen: set[str] = set()
    for rel in reversed(paths):
        defined_later[rel] = set(seen)
        seen |= _top_level_names(trees[rel])
    imports: list[str] = []
    parts: list[str] = []
    available = set(provided)
    for rel in paths:
        tree = trees[rel]
        text = (REPO / rel).read_text()
        aliases = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and _internal(node):
                for a in node.names:
                    if a.name not in available:
                        raise SystemExit(f"bundle: {rel} imports {a.name} from {node.module}, which no earlier "
                                         "module of the bundle defines")
                    if a.asname and a.asname != a.name:
                        aliases.append(f"{a.asname} = {a.name}")
        imports += [line for line in _external_imports(tree, set(provided)) if line not in imports]
        mine = _top_level_names(tree)
        clashes = mine & defined_later[rel]
        renames = {name: f"_{Path(rel).stem}_{name.lstrip('_')}" for name in clashes}
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
