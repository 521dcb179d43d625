"""Which protections an SGLang build has, judged from its code (see :mod:`sglang_harden.tools._source`).

Each detector looks for the *behaviour* in the function where it has to live, not for a version number or
a PR's wording, so a backported or locally patched tree is recognised. What each one looks for:

- ``door_rejection``: ``PrefillBootstrapQueue.add`` and ``DecodePreallocQueue.add`` each contain an ``if``
  whose test reads the field ``Req.set_finish_with_abort`` writes (``to_finish`` from 0.5.4.post2, else
  ``finished_reason``), directly or through a helper it calls (``is_aborted``, ``is_unadmitted_reject``),
  and whose branch leaves the door (return/raise). Both doors must have it.
- ``abort_retirement``: in ``process_batch_result_disagg_prefill`` the final
  ``send_kv_chunk(..., last_chunk=True)`` is dominated by such an abort test with an early exit
  (``continue``/``return``), or ``send_kv_chunk`` itself starts with one.
- ``coverage_check``: ``DecodeTransferQueue._commit_transfer_to_req`` or ``pop_transferred`` (or a helper
  they call) has an ``if`` comparing a transferred/sent length and aborting (or raising) on mismatch.
- ``kv_checksum``: decode has a ``*checksum*`` function that compares two computed values and handles a
  mismatch, and prefill publishes one; server arg ``disaggregation_enable_kv_checksum`` gives the default.
- ``deferred_release``: decode reads ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` and has a
  ``*defer*`` release path; ``environ.py`` gives the default; backends = transfer ``conn.py`` modules that
  honour it (that set ``supports_deferred_decode_kv_release = True`` where the base class gates on it).
- ``kv_canary``: a ``kv_canary`` server-arg field and the ``kv_canary`` kernel package; default from the
  field.
- ``abort_ack``: prefill sends ``ABORT_ACK``; deferred until drained if ``register_deferred_ack_target``
  exists; the KV sender's ``clear()`` either drops the pending target unconditionally (0.5.19/0.5.20) or
  keeps it until the writes drain (calls a ``*drain*`` helper); generation-tagged if ``note_abort_ack``
  takes a ``generation``.
- ``transfer_batch_bound``: ``environ.py`` declares ``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`` and
  ``mooncake/conn.py`` reads it; 0 means unbounded.
- ``decode_abort_notify``: a KV *sender*'s ``abort()`` (or a helper it calls) sends something to decode
  (a call named like notify / sync_status / send_multipart), so decode learns of a prefill-side abort.
- ``bootstrap_auth``: the bootstrap server's ``/route`` handlers read request headers or compare a secret
  (``compare_digest``, names with auth/token/secret/signature), or the aiohttp app has middlewares; opt-in
  (switch ``SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE``) when ``_setup_routes`` hands the app to a module named for
  authentication (the backport series' ``pd_auth.protect(self.app)``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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

SRT = "sglang.srt"
PREFILL = f"{SRT}.disaggregation.prefill"
DECODE = f"{SRT}.disaggregation.decode"
UTILS = f"{SRT}.disaggregation.utils"
ENVIRON = f"{SRT}.environ"
BACKENDS = ("mooncake", "nixl", "mori")

# native status values
YES = "yes"
OPT_IN = "opt-in"
PARTIAL = "partial"
NO = "no"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Protection:
    key: str
    title: str
    guard: str | None  # the sglang-harden guard that supplies it (config.GUARDS name)


PROTECTIONS: tuple[Protection, ...] = (
    Protection("door_rejection", "rejection at both PD doors", "admission"),
    Protection("abort_retirement", "retire aborted prefill results", "retire"),
    Protection("coverage_check", "transferred-length check on decode commit", "coverage"),
    Protection("kv_checksum", "per-transfer KV checksum", "checksum"),
    Protection("deferred_release", "deferred decode KV release", "lifecycle"),
    Protection("kv_canary", "kv canary", "canary"),
    Protection("abort_ack", "abort acknowledgement", "lifecycle"),
    Protection("transfer_batch_bound", "bounded Mooncake transfer batch", "lifecycle"),
    Protection("decode_abort_notify", "decode told of prefill aborts", "abort_notify"),
    Protection("bootstrap_auth", "bootstrap /route authentication", "bootstrap_auth"),
)


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
    ref = tree.function(f"{SRT}.managers.schedule_batch", "Req.set_finish_with_abort")
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


def _line(ref: FuncRef, node: ast.AST) -> str:
    return f"{ref.module.removeprefix('sglang.srt.')}:{ref.qualname} line {getattr(node, 'lineno', '?')}"


def _env_default(tree: SourceTree, name: str) -> tuple[bool, str | None]:
    found, value = class_field_default(tree.module(ENVIRON), name)
    if not found:
        return False, None
    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Constant):
        return True, repr(value.args[0].value)
    return True, ast.unparse(value) if value is not None else None


def _server_arg_default(tree: SourceTree, name: str) -> tuple[bool, str | None]:
    modules = [f"{SRT}.server_args", *tree.submodules(f"{SRT}.arg_groups")]
    for module in modules:
        found, value = class_field_default(tree.module(module), name)
        if found:
            if isinstance(value, ast.Constant):
                return True, repr(value.value)
            return True, ast.unparse(value) if value is not None else None
    return False, None


def _backend_modules(tree: SourceTree) -> dict[str, str]:
    out = {}
    for backend in BACKENDS:
        module = f"{SRT}.disaggregation.{backend}.conn"
        if tree.path(module).exists():
            out[backend] = module
    return out


def _sender_classes(tree: SourceTree) -> Iterable[tuple[str, str]]:
    modules = [f"{SRT}.disaggregation.common.conn", *_backend_modules(tree).values()]
    for module in modules:
        for name in tree.classes(module):
            if name.endswith("KVSender"):
                yield module, name


# ---------------------------------------------------------------------------------------------- detectors


def detect_door_rejection(tree: SourceTree) -> Native:
    fields = abort_fields(tree)
    doors = {
        "prefill": tree.function(PREFILL, "PrefillBootstrapQueue.add"),
        "decode": tree.function(DECODE, "DecodePreallocQueue.add"),
    }
    missing = [name for name, ref in doors.items() if ref is None]
    if missing:
        return Native(UNKNOWN, f"door function not found: {', '.join(missing)}")
    evidence, without = [], []
    for name, ref in doors.items():
        assert ref is not None
        hits = guarded_ifs(tree, ref, fields)
        if hits:
            evidence.append(f"{name}: {_line(ref, hits[0])} tests {'/'.join(sorted(fields))}")
        else:
            without.append(name)
            evidence.append(f"{name}: {ref.where} never tests {'/'.join(sorted(fields))} before admitting")
    if not without:
        return Native(YES, "both doors", evidence)
    if len(without) == 1:
        return Native(PARTIAL, f"{without[0]} door admits rejected requests", evidence)
    return Native(NO, "neither door checks the pending abort", evidence)


def detect_abort_retirement(tree: SourceTree) -> Native:
    fields = abort_fields(tree)
    ref = tree.function(PREFILL, "SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill")
    if ref is None:
        return Native(UNKNOWN, "process_batch_result_disagg_prefill not found")

    def is_guard(node: ast.If) -> bool:
        return test_reads(tree, ref, node.test, fields)

    sends = [c for c in calls(ref.node) if call_name(c) in ("send_kv_chunk", "_send_kv_chunk") and _last(c)]
    if not sends:
        return Native(UNKNOWN, "no send_kv_chunk(last_chunk=True) in process_batch_result_disagg_prefill")
    unguarded = [c for c in sends if dominated_by(ref.node, c, is_guard) is None]
    if not unguarded:
        guard = dominated_by(ref.node, sends[0], is_guard)
        return Native(YES, "aborted results skip the final send", [f"guard at {_line(ref, guard)}"])
    for name in ("send_kv_chunk", "_send_kv_chunk"):
        sender = tree.function(PREFILL, f"SchedulerDisaggregationPrefillMixin.{name}")
        if sender is not None and _starts_with_guard(tree, sender, fields):
            return Native(YES, f"{name} refuses aborted requests", [sender.where])
    return Native(
        NO,
        "aborted results reach the final KV send",
        [f"unguarded final send at {_line(ref, unguarded[0])}"],
    )


def _last(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "last_chunk":
            return isinstance(kw.value, ast.Constant) and kw.value.value is True
    return len(call.args) >= 2 and isinstance(call.args[1], ast.Constant) and call.args[1].value is True


def _starts_with_guard(tree: SourceTree, ref: FuncRef, fields: set[str]) -> bool:
    return any(
        isinstance(s, ast.If) and exits_early(s.body) and test_reads(tree, ref, s.test, fields) for s in ref.node.body
    )


_LEN_RE = re.compile(
    r"(transfer|sent|send|recv|receiv|cover|written|publish)\w*(len|tokens|count|num)"
    r"|(num|len|count)\w*(transfer|sent|recv|receiv|cover|written)",
    re.I,
)
_ABORT_CALL_RE = re.compile(r"abort|retire|fail", re.I)


def detect_coverage_check(tree: SourceTree) -> Native:
    roots = [
        tree.function(DECODE, "DecodeTransferQueue._commit_transfer_to_req"),
        tree.function(DECODE, "DecodeTransferQueue.pop_transferred"),
    ]
    roots = [r for r in roots if r is not None]
    if not roots:
        return Native(UNKNOWN, "DecodeTransferQueue commit path not found")
    for root in roots:
        for ref in tree.reachable(root, depth=1):
            hit = _length_compare(ref)
            if hit is not None:
                return Native(YES, "decode compares transferred length before commit", [_line(ref, hit)])
    return Native(NO, "decode commits without comparing transferred length", [r.where for r in roots])


def _length_compare(ref: FuncRef) -> ast.If | None:
    for node in ast.walk(ref.node):
        if not isinstance(node, ast.If):
            continue
        compares = [c for c in ast.walk(node.test) if isinstance(c, ast.Compare)]
        if not any(any(_LEN_RE.search(i) for i in identifiers(c)) for c in compares):
            continue
        body = ast.Module(body=node.body, type_ignores=[])
        if any(_ABORT_CALL_RE.search(call_name(c)) for c in calls(body)) or any(
            isinstance(s, ast.Raise) for s in ast.walk(body)
        ):
            return node
    return None


def detect_kv_checksum(tree: SourceTree) -> Native:
    decode_tree = tree.module(DECODE)
    if decode_tree is None:
        return Native(UNKNOWN, "disaggregation/decode.py not found")
    verifier = None
    for node in ast.walk(decode_tree):
        if isinstance(node, ast.FunctionDef) and "checksum" in node.name.lower() and _compares_values(node):
            verifier = node
            break
    if verifier is None:
        return Native(NO, "decode never verifies a KV digest")
    publishes = any(
        "checksum" in call_name(c).lower()
        for module in (PREFILL, UTILS)
        if (t := tree.module(module)) is not None
        for c in calls(t)
    )
    found, default = _server_arg_default(tree, "disaggregation_enable_kv_checksum")
    evidence = [f"disaggregation/decode.py:{verifier.name} line {verifier.lineno}"]
    if not publishes:
        return Native(PARTIAL, "decode verifies but prefill publishes no digest", evidence)
    switch = "--disaggregation-enable-kv-checksum"
    if found and default in ("False", "None"):
        return Native(OPT_IN, "off by default", evidence, switch=switch, default="off")
    return Native(YES, "on", evidence, switch=switch if found else None, default=default)


def _compares_values(func: ast.FunctionDef) -> bool:
    has_compare = any(
        isinstance(n, ast.Compare)
        and all(isinstance(op, ast.Eq | ast.NotEq) for op in n.ops)
        and not any(isinstance(x, ast.Constant) for x in [n.left, *n.comparators])
        for n in ast.walk(func)
    )
    handles = any(re.search(r"mismatch|abort|fail", call_name(c), re.I) for c in calls(func)) or any(
        isinstance(n, ast.Raise) for n in ast.walk(func)
    )
    return has_compare and handles


DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


def detect_deferred_release(tree: SourceTree) -> Native:
    decode_text = tree.text(DECODE)
    if DEFERRED_ENV not in decode_text or not re.search(r"def _?\w*defer\w*\(", decode_text):
        return Native(NO, "decode frees KV as soon as a transfer concludes")
    _, default = _env_default(tree, DEFERRED_ENV)
    backends = _deferred_backends(tree)
    where = ", ".join(backends) if backends else "no backend"
    evidence = [f"decode reads {DEFERRED_ENV}", f"backends honouring it: {where}"]
    if default in ("True", "1", "'1'", "'true'"):
        return Native(YES, f"on for {where}", evidence, switch=DEFERRED_ENV, default="on")
    return Native(OPT_IN, f"env, default off ({where})", evidence, switch=DEFERRED_ENV, default="off")


def _deferred_backends(tree: SourceTree) -> list[str]:
    gated = "supports_deferred_decode_kv_release" in tree.text(f"{SRT}.disaggregation.common.conn")
    out = []
    for backend, module in _backend_modules(tree).items():
        text = tree.text(module)
        if gated:
            if re.search(r"supports_deferred_decode_kv_release\s*=\s*True", text):
                out.append(backend)
        elif "enable_deferred_decode_kv_release" in text:
            out.append(backend)
    return out


def detect_kv_canary(tree: SourceTree) -> Native:
    found, default = _server_arg_default(tree, "kv_canary")
    kernel = tree.exists("sglang.kernels.ops.kv_canary") or tree.exists(f"{SRT}.kv_canary")
    if not found or not kernel:
        return Native(NO, "no kv canary")
    evidence = ["server arg kv_canary", "sglang/kernels/ops/kv_canary"]
    if default in ("'none'", "None", "False"):
        return Native(OPT_IN, f"default {default}", evidence, switch="--kv-canary", default="none")
    return Native(YES, f"default {default}", evidence, switch="--kv-canary", default=default)


def detect_abort_ack(tree: SourceTree) -> Native:
    common = f"{SRT}.disaggregation.common.conn"
    texts = {b: tree.text(m) for b, m in _backend_modules(tree).items()}
    texts["common"] = tree.text(common)
    senders = sorted(b for b, t in texts.items() if "ABORT_ACK" in t and b != "common")
    if not any("ABORT_ACK" in t for t in texts.values()):
        return Native(NO, "prefill never acknowledges an abort")
    if "register_deferred_ack_target" not in "".join(texts.values()):
        return Native(PARTIAL, "ack on receipt only (not after drain)", [f"ABORT_ACK in {senders}"])
    clear_refs = _unique(tree.function(m, f"{c}.clear") for m, c in _sender_classes(tree))
    keeping = [r for r in clear_refs if _keeps_until_drained(r)]
    dropping = [r for r in clear_refs if r not in keeping and "_deferred_ack_targets" in ast.unparse(r.node)]
    if dropping and not keeping:
        return Native(
            PARTIAL,
            "drain-deferred, but clear() drops the ack target",
            [f"{r.where} pops _deferred_ack_targets unconditionally" for r in dropping],
        )
    if not keeping:
        return Native(UNKNOWN, "no KV sender clear() that keeps or drops the ack target")
    ack = tree.function(common, "CommonKVManager.note_abort_ack")
    tagged = ack is not None and any(a.arg == "generation" for a in ack.node.args.args)
    detail = "retained until drained" + (", generation-tagged" if tagged else "")
    return Native(YES, f"{detail} ({', '.join(senders) or 'common'})", [f"{r.where} defers to drain" for r in keeping])


def _unique(refs: Iterable[FuncRef | None]) -> list[FuncRef]:
    seen: dict[tuple[str, str], FuncRef] = {}
    for ref in refs:
        if ref is not None:
            seen.setdefault((ref.module, ref.qualname), ref)
    return list(seen.values())


def _keeps_until_drained(ref: FuncRef) -> bool:
    return any("drain" in call_name(c).lower() for c in calls(ref.node))


BATCH_ENV = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"


def detect_transfer_batch_bound(tree: SourceTree) -> Native:
    declared, default = _env_default(tree, BATCH_ENV)
    used = BATCH_ENV in tree.text(f"{SRT}.disaggregation.mooncake.conn")
    if not (declared and used):
        return Native(NO, "Mooncake transfers a request's pages in one unbounded batch")
    evidence = [f"environ {BATCH_ENV}={default}", "read in mooncake/conn.py"]
    if default in ("0", "None"):
        return Native(OPT_IN, f"env, default {default} (unbounded)", evidence, switch=BATCH_ENV, default="0")
    return Native(YES, f"default {default}", evidence, switch=BATCH_ENV, default=default)


_NOTIFY_RE = re.compile(r"notify|sync_status|send_multipart|status_to_decode|send_kv_status", re.I)


_REJECTIONS_RE = re.compile(r"reject|abort", re.I)


def detect_decode_abort_notify(tree: SourceTree) -> Native:
    channel = _rejection_channel(tree)
    if channel is not None:
        return Native(YES, "prefill posts its rejections and aborts to its bootstrap server, decode polls them "
                      "(sglang-harden's /pd_rejections)", channel)
    aborts = _unique(tree.function(m, f"{c}.abort") for m, c in _sender_classes(tree))
    if not aborts:
        return Native(UNKNOWN, "no KV sender abort() found")
    for ref in aborts:
        for reached in tree.reachable(ref, depth=2):
            hit = next((c for c in calls(reached.node) if _NOTIFY_RE.search(call_name(c))), None)
            if hit is not None:
                return Native(YES, "prefill abort is sent to decode", [_line(reached, hit)])
    evidence = [f"{a.where} only records locally" for a in aborts]
    return Native(NO, "decode waits for its waiting timeout", evidence)


_AUTH_RE = re.compile(r"auth|token|secret|signature|hmac|compare_digest", re.I)


def detect_bootstrap_auth(tree: SourceTree) -> Native:
    module = f"{SRT}.disaggregation.common.conn"
    handlers = [
        tree.function(module, f"CommonKVBootstrapServer.{name}") for name in ("_handle_route", "_handle_route_put")
    ]
    handlers = [h for h in handlers if h is not None]
    if not handlers:
        return Native(UNKNOWN, "bootstrap server /route handler not found")
    for root in handlers:
        for ref in tree.reachable(root, depth=1):
            names = attr_loads(ref.node) | {call_name(c) for c in calls(ref.node)}
            if "headers" in names or any(_AUTH_RE.search(n) for n in names):
                return Native(YES, "/route checks credentials", [ref.where])
    server_tree = tree.module(module)
    if server_tree is not None:
        for call in calls(server_tree):
            if call_name(call) == "Application" and any(k.arg == "middlewares" for k in call.keywords):
                return Native(YES, "bootstrap app has middlewares", [f"line {call.lineno}"])
    setup = tree.function(module, "CommonKVBootstrapServer._setup_routes")
    backport = _auth_module_call(setup) if setup is not None else None
    if backport is not None:
        return Native(OPT_IN, f"every bootstrap route checks a token once {BACKPORT_SECRET_ENV} names a secret file "
                      "(sglang-harden backport)", [f"{setup.where}: {backport}"], switch=BACKPORT_SECRET_ENV)
    return Native(NO, "PUT /route accepts anyone", [h.where for h in handlers])


BACKPORT_SECRET_ENV = "SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"


def _auth_module_call(ref: FuncRef) -> str | None:
    """``<module>.<fn>(self.app)`` where the module's name says authentication (the backport's
    ``pd_auth.protect(self.app)``): the app's middlewares are set up outside this file."""
    return _module_call_on_app(ref, _AUTH_RE)


def _module_call_on_app(ref: FuncRef, module_name: re.Pattern[str]) -> str | None:
    for call in calls(ref.node):
        func = call.func
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and module_name.search(func.value.id)
                and any("app" in attr_loads(arg) for arg in call.args)):
            return f"{func.value.id}.{func.attr}(...)"
    return None


_CHANNEL_HOSTS = (("common", "CommonKVBootstrapServer", "CommonKVManager"),
                  ("mooncake", "MooncakeKVBootstrapServer", "MooncakeKVManager"))  # 0.4.9: Mooncake's own server


def _rejection_channel(tree: SourceTree) -> list[str] | None:
    """The backport's notice channel: a bootstrap server's ``_setup_routes`` adds a rejections module's routes
    (``pd_rejections.add_routes(self.app)``) and the KV manager beside it starts that module's watcher."""
    for package, server, manager_class in _CHANNEL_HOSTS:
        module = f"{SRT}.disaggregation.{package}.conn"
        setup = tree.function(module, f"{server}._setup_routes")
        manager = tree.function(module, f"{manager_class}.__init__")
        if setup is None or manager is None:
            continue
        routes = _module_call_on_app(setup, _REJECTIONS_RE)
        watcher = next((call_name(c) for c in calls(manager.node) if "watcher" in call_name(c).lower()), None)
        if routes is not None and watcher is not None:
            return [f"{setup.where}: {routes}", f"{manager.where}: {watcher}(...)"]
    return None


DETECTORS: dict[str, Callable[[SourceTree], Native]] = {
    "door_rejection": detect_door_rejection,
    "abort_retirement": detect_abort_retirement,
    "coverage_check": detect_coverage_check,
    "kv_checksum": detect_kv_checksum,
    "deferred_release": detect_deferred_release,
    "kv_canary": detect_kv_canary,
    "abort_ack": detect_abort_ack,
    "transfer_batch_bound": detect_transfer_batch_bound,
    "decode_abort_notify": detect_decode_abort_notify,
    "bootstrap_auth": detect_bootstrap_auth,
}


def inspect_tree(tree: SourceTree) -> dict[str, Native]:
    out = {}
    for key, detector in DETECTORS.items():
        try:
            out[key] = detector(tree)
        except RecursionError:
            out[key] = Native(UNKNOWN, "code too deeply nested to inspect")
    return out
