"""Detectors of the protections on a request's own path: rejection at both PD doors, retirement of aborted
prefill results, decode's transferred-length check, the per-transfer KV checksum and the page ownership check."""

from __future__ import annotations

import ast
import re

from sglang_harden.compat.internals import (
    COMMIT,
    DECODE_DOOR,
    POP_TRANSFERRED,
    PREFILL_DOOR,
)
from sglang_harden.tools._detect_base import (
    DECODE,
    NO,
    OPT_IN,
    PARTIAL,
    PREFILL,
    UNKNOWN,
    UTILS,
    YES,
    Native,
    abort_fields,
    aborting_if,
    allocator_frees,
    branch_aborts,
    commit_point,
    dominated_by,
    gated_check,
    guarded_ifs,
    line_of,
    server_arg_default,
    test_reads,
)
from sglang_harden.tools._source import FuncRef, SourceTree, call_name, calls, exits_early, identifiers


def detect_door_rejection(tree: SourceTree) -> Native:
    fields = abort_fields(tree)
    doors = {
        "prefill": tree.function(*PREFILL_DOOR),
        "decode": tree.function(*DECODE_DOOR),
    }
    missing = [name for name, ref in doors.items() if ref is None]
    if missing:
        return Native(UNKNOWN, f"door function not found: {', '.join(missing)}")
    evidence, without = [], []
    for name, ref in doors.items():
        assert ref is not None
        hits = guarded_ifs(tree, ref, fields)
        if hits:
            evidence.append(f"{name}: {line_of(ref, hits[0])} tests {'/'.join(sorted(fields))}")
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
        return Native(YES, "aborted results skip the final send", [f"guard at {line_of(ref, guard)}"])
    for name in ("send_kv_chunk", "_send_kv_chunk"):
        sender = tree.function(PREFILL, f"SchedulerDisaggregationPrefillMixin.{name}")
        if sender is not None and _starts_with_guard(tree, sender, fields):
            return Native(YES, f"{name} refuses aborted requests", [sender.where])
    return Native(
        NO,
        "aborted results reach the final KV send",
        [f"unguarded final send at {line_of(ref, unguarded[0])}"],
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


def detect_coverage_check(tree: SourceTree) -> Native:
    roots = [
        tree.function(*COMMIT),
        tree.function(*POP_TRANSFERRED),
    ]
    roots = [r for r in roots if r is not None]
    if not roots:
        return Native(UNKNOWN, "DecodeTransferQueue commit path not found")
    for root in roots:
        for ref in tree.reachable(root, depth=1):
            hit = _length_compare(ref)
            if hit is not None:
                return Native(YES, "decode compares transferred length before commit", [line_of(ref, hit)])
    return Native(NO, "decode commits without comparing transferred length", [r.where for r in roots])


def _length_compare(ref: FuncRef) -> ast.If | None:
    for node in ast.walk(ref.node):
        if not isinstance(node, ast.If):
            continue
        compares = [c for c in ast.walk(node.test) if isinstance(c, ast.Compare)]
        if any(any(_LEN_RE.search(i) for i in identifiers(c)) for c in compares) and branch_aborts(node):
            return node
    return None


_DIGEST_RE = re.compile(r"digest", re.I)
# a call that publishes a digest (``pd_digest.publish_before_final_send``), not any ``.digest()`` (hashlib's)
_DIGEST_PUBLISH_RE = re.compile(r"digest\w*\.publish|publish\w*digest", re.I)


def _backported_digest(tree: SourceTree) -> Native | None:
    """The backport series' digest: decode's commit gate or commit path aborts on a digest verdict (``pd_digest``),
    on by default; None when neither has such a check."""
    gated = gated_check(tree, "checksum")
    commit = commit_point(tree)
    if gated is not None:
        evidence = [gated]
    else:
        check = next((hit for ref in tree.reachable(commit, depth=1)
                      if (hit := aborting_if(ref, _DIGEST_RE)) is not None), None) if commit is not None else None
        if commit is None or check is None:
            return None
        evidence = [line_of(commit, check)]
    prefill = tree.module(PREFILL)
    if prefill is None or not any(_DIGEST_PUBLISH_RE.search(ast.unparse(c.func)) for c in calls(prefill)):
        return Native(PARTIAL, "decode verifies a KV digest but prefill publishes none", evidence)
    return Native(YES, "decode verifies the KV digest prefill publishes (on by default)", evidence)


def detect_kv_checksum(tree: SourceTree) -> Native:
    backport = _backported_digest(tree)
    if backport is not None:
        return backport
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
    found, default = server_arg_default(tree, "disaggregation_enable_kv_checksum")
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


_OWNERSHIP_RE = re.compile(r"page_?tag|page_?owner|ownership", re.I)
_LEDGER_CALL_RE = re.compile(r"note_freed|ledger|page_?tag", re.I)


def detect_page_ownership(tree: SourceTree) -> Native:
    """Decode's commit path aborts on a page-ownership verdict, and both allocators' free paths tell the ledger
    behind it that pages came back (the backport series' ``pd_page_tags``)."""
    commit = commit_point(tree)
    if commit is None:
        return Native(UNKNOWN, "DecodeTransferQueue._commit_transfer_to_req and pop_transferred not found")
    gated = gated_check(tree, "page_tags")
    check = next((hit for ref in tree.reachable(commit, depth=1)
                  if (hit := aborting_if(ref, _OWNERSHIP_RE)) is not None), None)
    if check is None and gated is None:
        return Native(NO, "decode commits without checking whose pages the request reads", [commit.where])
    evidence = [gated] if gated is not None else [line_of(commit, check)]
    frees = allocator_frees(tree)
    silent = [ref.where for ref in frees if not any(_LEDGER_CALL_RE.search(call_name(c)) for c in calls(ref.node))]
    if silent or not frees:
        return Native(PARTIAL, "the ownership ledger is not told of freed pages", evidence + silent)
    return Native(YES, "decode checks page ownership before commit", evidence)
