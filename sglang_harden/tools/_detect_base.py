"""What doctor's protection detectors share: the verdict they return (:class:`Native`, status values), the
SGLang module names they read, and the AST helpers several of them use (abort-field tests, dominating guards,
defaults of env vars and server args, KV backends and senders)."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sglang_harden.compat.internals import (  # noqa: F401 - the detectors import SGLang's names from here
    ARG_GROUPS,
    COMMIT,
    CONN,
    DECODE,
    ENVIRON,
    GATED_CHECK_MODULES,
    KV_CANARY_MODULES,
    MOONCAKE,
    PAGED_FREE_ONE_MODULE,
    PAGED_RELEASE,
    POLL_RECEIVERS,
    POP_TRANSFERRED,
    PREFILL,
    SERVER_ARGS,
    SET_FINISH_WITH_ABORT,
    SRT,
    TOKEN_FREE,
    TOKEN_FREE_ONE_MODULE,
    UTILS,
    backend_module,
)
from sglang_harden.tools._source import (
    FuncRef,
    SourceTree,
    attr_loads,
    call_name,
    calls,
    class_field_default,
    exits_early,
    identifiers,
)

BACKENDS = ("mooncake", "nixl", "mori")

# native status values
YES = "yes"
OPT_IN = "opt-in"
PARTIAL = "partial"
NO = "no"
UNKNOWN = "unknown"


@dataclass
class Native:
    """What the build itself does for one protection."""

    status: str
    detail: str
    evidence: list[str] = field(default_factory=list)
    switch: str | None = None  # env var or flag that turns it on/off
    default: str | None = None


# ---------------------------------------------------------------------------------------------- helpers




def abort_fields(tree: SourceTree) -> set[str]:
    """The Req field(s) a pending abort is recorded in: what ``set_finish_with_abort`` assigns."""
    ref = tree.function(*SET_FINISH_WITH_ABORT)
    if ref is None:
        return {"finished_reason"}
    written = {
        t.attr
        for n in ast.walk(ref.node)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    return (written & {"to_finish", "finished_reason"}) or {"finished_reason"}


def test_reads(tree: SourceTree, ref: FuncRef, expr: ast.AST, fields: set[str], depth: int = 3) -> bool:
    """``expr`` (an if-test) depends on one of ``fields``, directly or via a helper's return value."""
    if attr_loads(expr) & fields:
        return True
    if depth <= 0:
        return False
    for call in calls(expr):
        target = tree.callee(ref, call)
        if target is not None and _helper_reports(tree, target, fields, depth - 1):
            return True
    return False


def _helper_reports(tree: SourceTree, ref: FuncRef, fields: set[str], depth: int) -> bool:
    for node in ast.walk(ref.node):
        if isinstance(node, ast.Return) and node.value is not None:
            if test_reads(tree, ref, node.value, fields, depth):
                return True
        if isinstance(node, ast.If) and exits_early(node.body):
            if test_reads(tree, ref, node.test, fields, depth):
                return True
    return False


def guarded_ifs(tree: SourceTree, ref: FuncRef, fields: set[str]) -> list[ast.If]:
    """``if`` statements in ``ref`` whose test reads ``fields`` and whose branch exits early."""
    return [
        n
        for n in ast.walk(ref.node)
        if isinstance(n, ast.If) and exits_early(n.body) and test_reads(tree, ref, n.test, fields)
    ]


def _parents(root: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(root) for child in ast.iter_child_nodes(parent)}


def dominated_by(root: ast.AST, target: ast.AST, is_guard: Callable[[ast.If], bool]) -> ast.If | None:
    """An ``if`` that the path to ``target`` must pass: an earlier sibling (at any nesting level) that is a
    guard with an early exit, or an enclosing ``if`` whose test is a guard."""
    parents = _parents(root)
    node: ast.AST = target
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and node is not parent.test and is_guard(parent):
            return parent
        for block_name in ("body", "orelse", "finalbody"):
            block = getattr(parent, block_name, None)
            if isinstance(block, list) and node in block:
                for earlier in block[: block.index(node)]:
                    if isinstance(earlier, ast.If) and exits_early(earlier.body) and is_guard(earlier):
                        return earlier
        node = parent
    return None


def line_of(ref: FuncRef, node: ast.AST) -> str:
    return f"{ref.module.removeprefix(SRT + '.')}:{ref.qualname} line {getattr(node, 'lineno', '?')}"


def env_default(tree: SourceTree, name: str) -> tuple[bool, str | None]:
    found, value = class_field_default(tree.module(ENVIRON), name)
    if not found:
        return False, None
    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Constant):
        return True, repr(value.args[0].value)
    return True, ast.unparse(value) if value is not None else None


def server_arg_default(tree: SourceTree, name: str) -> tuple[bool, str | None]:
    modules = [SERVER_ARGS, *tree.submodules(ARG_GROUPS)]
    for module in modules:
        found, value = class_field_default(tree.module(module), name)
        if found:
            if isinstance(value, ast.Constant):
                return True, repr(value.value)
            return True, ast.unparse(value) if value is not None else None
    return False, None


def backend_modules(tree: SourceTree) -> dict[str, str]:
    out = {}
    for backend in BACKENDS:
        module = backend_module(backend)
        if tree.path(module).exists():
            out[backend] = module
    return out


def sender_classes(tree: SourceTree) -> Iterable[tuple[str, str]]:
    modules = [CONN, *backend_modules(tree).values()]
    for module in modules:
        for name in tree.classes(module):
            if name.endswith("KVSender"):
                yield module, name


def unique_refs(refs: Iterable[FuncRef | None]) -> list[FuncRef]:
    seen: dict[tuple[str, str], FuncRef] = {}
    for ref in refs:
        if ref is not None:
            seen.setdefault((ref.module, ref.qualname), ref)
    return list(seen.values())


ABORT_CALL_RE = re.compile(r"abort|retire|fail", re.I)


def aborting_if(ref: FuncRef, test_names: re.Pattern[str]) -> ast.If | None:
    """The first ``if`` in ``ref`` whose test names something ``test_names`` matches and whose branch aborts the
    request (a call named like abort / retire / fail) or raises."""
    for node in ast.walk(ref.node):
        if isinstance(node, ast.If) and any(test_names.search(i) for i in identifiers(node.test)) and \
                branch_aborts(node):
            return node
    return None


def branch_aborts(node: ast.If) -> bool:
    """The ``if``'s branch aborts the request (a call named like abort / retire / fail) or raises."""
    body = ast.Module(body=node.body, type_ignores=[])
    return any(ABORT_CALL_RE.search(call_name(c)) for c in calls(body)) or any(
        isinstance(s, ast.Raise) for s in ast.walk(body))


def gated_check(tree: SourceTree, guard: str) -> str | None:
    """Evidence that the backport series' commit gate runs ``guard``'s check: SGLang polls every receiver through
    the gate (``judge_polls``) and the guard's module defines the gate's step (``GATE_STEP``); None otherwise."""
    polls = tree.function(*POLL_RECEIVERS)
    if polls is None or not any("judge_polls" in call_name(c) for c in calls(polls.node)):
        return None
    module = tree.module(GATED_CHECK_MODULES[guard])
    steps = [n for n in (module.body if module is not None else []) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "GATE_STEP" for t in n.targets)]
    if not steps:
        return None
    return f"{polls.where} polls every receiver through the commit gate, which runs {guard}'s GATE_STEP"


def commit_point(tree: SourceTree) -> FuncRef | None:
    """Where decode commits a finished transfer: ``_commit_transfer_to_req``, or on 0.4.x (which has none)
    ``pop_transferred`` itself."""
    return tree.function(*COMMIT) or tree.function(*POP_TRANSFERRED)


def allocator_frees(tree: SourceTree) -> list[FuncRef]:
    """The token and paged allocators' free paths: ``free`` and ``_release_page_ids`` of their own modules, or before
    the 0.5.13 split both ``free`` methods of ``mem_cache/allocator.py``."""
    frees = [ref for target in (TOKEN_FREE, PAGED_RELEASE) if (ref := tree.function(*target)) is not None]
    return frees or [ref for target in (TOKEN_FREE_ONE_MODULE, PAGED_FREE_ONE_MODULE)
                     if (ref := tree.function(*target)) is not None]
