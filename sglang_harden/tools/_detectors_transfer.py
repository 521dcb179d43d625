"""Detectors of the KV transfer lifecycle protections: deferred decode KV release, the kv canary, abort
acknowledgement after drain and the bounded Mooncake transfer batch."""

from __future__ import annotations

import ast
import re

from sglang_harden.compat.internals import NOTE_ABORT_ACK, POP_TRANSFERRED
from sglang_harden.tools._detect_base import (
    CONN,
    DECODE,
    KV_CANARY_MODULES,
    MOONCAKE,
    NO,
    OPT_IN,
    PARTIAL,
    UNKNOWN,
    YES,
    Native,
    aborting_if,
    allocator_frees,
    backend_modules,
    commit_point,
    env_default,
    gated_check,
    line_of,
    sender_classes,
    server_arg_default,
    unique_refs,
)
from sglang_harden.tools._source import FuncRef, SourceTree, call_name, calls

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


def detect_deferred_release(tree: SourceTree) -> Native:
    decode_text = tree.text(DECODE)
    if DEFERRED_ENV not in decode_text or not re.search(r"def _?\w*defer\w*\(", decode_text):
        return Native(NO, "decode frees KV as soon as a transfer concludes")
    _, default = env_default(tree, DEFERRED_ENV)
    backends = _deferred_backends(tree)
    where = ", ".join(backends) if backends else "no backend"
    evidence = [f"decode reads {DEFERRED_ENV}", f"backends honouring it: {where}"]
    if default in ("True", "1", "'1'", "'true'"):
        return Native(YES, f"on for {where}", evidence, switch=DEFERRED_ENV, default="on")
    return Native(OPT_IN, f"env, default off ({where})", evidence, switch=DEFERRED_ENV, default="off")


def _deferred_backends(tree: SourceTree) -> list[str]:
    gated = "supports_deferred_decode_kv_release" in tree.text(CONN)
    out = []
    for backend, module in backend_modules(tree).items():
        text = tree.text(module)
        if gated:
            if re.search(r"supports_deferred_decode_kv_release\s*=\s*True", text):
                out.append(backend)
        elif "enable_deferred_decode_kv_release" in text:
            out.append(backend)
    return out


_CANARY_RE = re.compile(r"canary", re.I)


def detect_kv_canary(tree: SourceTree) -> Native:
    gated = gated_check(tree, "canary")
    if gated is not None:
        return Native(YES, "decode's commit gate checks its canary stamps before commit (backport)", [gated],
                      switch="SGLANG_HARDEN_CANARY", default="enforce")
    commit = commit_point(tree)
    patched = next((hit for ref in tree.reachable(commit, depth=1) if (hit := aborting_if(ref, _CANARY_RE))),
                   None) if commit is not None else None
    if commit is not None and patched is not None:
        return Native(YES, "decode checks its canary stamps before commit (backport)", [line_of(commit, patched)],
                      switch="SGLANG_HARDEN_CANARY", default="enforce")
    found, default = server_arg_default(tree, "kv_canary")
    kernel = any(tree.exists(module) for module in KV_CANARY_MODULES)
    if not found or not kernel:
        return Native(NO, "no kv canary")
    evidence = ["server arg kv_canary", "sglang/kernels/ops/kv_canary"]
    if default in ("'none'", "None", "False"):
        return Native(OPT_IN, f"default {default}", evidence, switch="--kv-canary", default="none")
    return Native(YES, f"default {default}", evidence, switch="--kv-canary", default=default)


def detect_abort_ack(tree: SourceTree) -> Native:
    common = CONN
    texts = {b: tree.text(m) for b, m in backend_modules(tree).items()}
    texts["common"] = tree.text(common)
    senders = sorted(b for b, t in texts.items() if "ABORT_ACK" in t and b != "common")
    if not any("ABORT_ACK" in t for t in texts.values()):
        return Native(NO, "prefill never acknowledges an abort")
    if "register_deferred_ack_target" not in "".join(texts.values()):
        return Native(PARTIAL, "ack on receipt only (not after drain)", [f"ABORT_ACK in {senders}"])
    clear_refs = unique_refs(tree.function(m, f"{c}.clear") for m, c in sender_classes(tree))
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
    ack = tree.function(*NOTE_ABORT_ACK)
    tagged = ack is not None and any(a.arg == "generation" for a in ack.node.args.args)
    detail = "retained until drained" + (", generation-tagged" if tagged else "")
    return Native(YES, f"{detail} ({', '.join(senders) or 'common'})", [f"{r.where} defers to drain" for r in keeping])


def _keeps_until_drained(ref: FuncRef) -> bool:
    return any("drain" in call_name(c).lower() for c in calls(ref.node))


BATCH_ENV = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"


def detect_transfer_batch_bound(tree: SourceTree) -> Native:
    declared, default = env_default(tree, BATCH_ENV)
    used = BATCH_ENV in tree.text(MOONCAKE)
    if not (declared and used):
        return Native(NO, "Mooncake transfers a request's pages in one unbounded batch")
    evidence = [f"environ {BATCH_ENV}={default}", "read in mooncake/conn.py"]
    if default in ("0", "None"):
        return Native(OPT_IN, f"env, default {default} (unbounded)", evidence, switch=BATCH_ENV, default="0")
    return Native(YES, f"default {default}", evidence, switch=BATCH_ENV, default=default)


_KEEP_BACK_RE = re.compile(r"quarantin|lifecycle|to_free|keep_back", re.I)
_RELEASE_HELD_RE = re.compile(r"quarantin|release_drained|confirm_drained|lifecycle", re.I)


def _filters_what_it_frees(ref: FuncRef) -> bool:
    """The free path reassigns what it is about to free from a call named for keeping pages back."""
    return any(isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
               and _KEEP_BACK_RE.search(call_name(node.value)) for node in ast.walk(ref.node))


def detect_page_quarantine(tree: SourceTree) -> Native:
    """Both allocators' free paths keep back pages a transfer may still write (quarantine), and decode's transfer
    queue lets them out once their writers drained (the backport series' ``pd_lifecycle``). No SGLang release
    has it: upstream's deferred release frees on a timeout."""
    frees = allocator_frees(tree)
    if not frees:
        return Native(UNKNOWN, "no KV allocator free path found")
    filtering = [ref.where for ref in frees if _filters_what_it_frees(ref)]
    if not filtering:
        return Native(NO, "the allocators free every page they are given", [ref.where for ref in frees])
    pop = tree.function(*POP_TRANSFERRED)
    releases = pop is not None and any(_RELEASE_HELD_RE.search(call_name(c)) for c in calls(pop.node))
    if len(filtering) < len(frees) or not releases:
        return Native(PARTIAL, "pages are kept back on some free paths, or never let out of quarantine", filtering)
    return Native(YES, "freed pages a transfer may still write stay in quarantine until its writers drain",
                  filtering + [pop.where])
