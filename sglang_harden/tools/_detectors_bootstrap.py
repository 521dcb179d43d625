"""Detectors of what runs through the bootstrap server, the KV sender's abort and the KV managers' ZMQ side
channels: decode told of prefill aborts (natively or by the backport's rejection channel), ``/route``
authentication and the rank ports' message authentication."""

from __future__ import annotations

import ast
import re

from sglang_harden.compat.internals import BOOTSTRAP_SERVERS, RANK_PORT_BINDS, RECEIVER_CONNECTS
from sglang_harden.tools._detect_base import (
    CONN,
    NO,
    OPT_IN,
    PARTIAL,
    UNKNOWN,
    YES,
    Native,
    backend_module,
    line_of,
    sender_classes,
    unique_refs,
)
from sglang_harden.tools._source import FuncRef, SourceTree, attr_loads, call_name, calls

_NOTIFY_RE = re.compile(r"notify|sync_status|send_multipart|status_to_decode|send_kv_status", re.I)


_REJECTIONS_RE = re.compile(r"reject|abort", re.I)


def detect_decode_abort_notify(tree: SourceTree) -> Native:
    channel = _rejection_channel(tree)
    if channel is not None:
        return Native(YES, "prefill posts its rejections and aborts to its bootstrap server, decode polls them "
                      "(sglang-harden's /pd_rejections)", channel)
    aborts = unique_refs(tree.function(m, f"{c}.abort") for m, c in sender_classes(tree))
    if not aborts:
        return Native(UNKNOWN, "no KV sender abort() found")
    for ref in aborts:
        for reached in tree.reachable(ref, depth=2):
            hit = next((c for c in calls(reached.node) if _NOTIFY_RE.search(call_name(c))), None)
            if hit is not None:
                return Native(YES, "prefill abort is sent to decode", [line_of(reached, hit)])
    evidence = [f"{a.where} only records locally" for a in aborts]
    return Native(NO, "decode waits for its waiting timeout", evidence)


_AUTH_RE = re.compile(r"auth|token|secret|signature|hmac|compare_digest", re.I)


def _route_handlers(tree: SourceTree) -> tuple[str, str, list[FuncRef]]:
    """The first bootstrap server class with /route handlers: (its module, its name, the handlers)."""
    for module, server in BOOTSTRAP_SERVERS:
        found = [tree.function(module, f"{server}.{name}") for name in ("_handle_route", "_handle_route_put")]
        handlers = [h for h in found if h is not None]
        if handlers:
            return module, server, handlers
    return CONN, "", []


def detect_bootstrap_auth(tree: SourceTree) -> Native:
    module, server, handlers = _route_handlers(tree)
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
    setup = tree.function(module, f"{server}._setup_routes")
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
        module = backend_module(package)
        setup = tree.function(module, f"{server}._setup_routes")
        manager = tree.function(module, f"{manager_class}.__init__")
        if setup is None or manager is None:
            continue
        routes = _module_call_on_app(setup, _REJECTIONS_RE)
        watcher = next((call_name(c) for c in calls(manager.node) if "watcher" in call_name(c).lower()), None)
        if routes is not None and watcher is not None:
            return [f"{setup.where}: {routes}", f"{manager.where}: {watcher}(...)"]
    return None


_SIDE_RE = re.compile(r"side_channel|zmq_auth", re.I)
BACKPORT_ZMQ_SWITCH = "SGLANG_HARDEN_ZMQ_AUTH"  # on with the control-plane secret file unless this (or its auth) is off


def _module_call(ref: FuncRef, module_name: re.Pattern[str]) -> str | None:
    """``<module>.<fn>(...)`` in ``ref`` where the module's name matches (the backport's ``pd_side_channels``)."""
    for call in calls(ref.node):
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and module_name.search(func.value.id):
            return f"{func.value.id}.{func.attr}(...)"
    return None


def _first_found(tree: SourceTree, places: tuple[tuple[str, str], ...]) -> FuncRef | None:
    """The first of ``places`` this tree has (the ZMQ side channels sit in different classes across releases)."""
    for module, name in places:
        found = tree.function(module, name)
        if found is not None:
            return found
    return None


def detect_zmq_auth(tree: SourceTree) -> Native:
    """The KV manager's rank port admits only authenticated messages and decode's sockets to it sign: the
    backport's ``pd_side_channels`` calls in ``CommonKVManager.__init__`` (after the bind) and
    ``CommonKVReceiver._connect`` (0.4.x: Mooncake's ``_bind_server_socket`` and its receiver's ``_connect``). No
    SGLang release authenticates these messages."""
    init = _first_found(tree, RANK_PORT_BINDS)
    if init is None:
        return Native(UNKNOWN, f"none of {', '.join(name for _, name in RANK_PORT_BINDS)} found")
    receiver = _first_found(tree, RECEIVER_CONNECTS)
    guard = _module_call(init, _SIDE_RE)
    sign = _module_call(receiver, _SIDE_RE) if receiver is not None else None
    if guard is not None and sign is not None:
        return Native(OPT_IN, f"rank ports verify and peers sign every ZMQ message once {BACKPORT_SECRET_ENV} names "
                      "a secret file (sglang-harden backport)", [f"{init.where}: {guard}", f"{receiver.where}: {sign}"],
                      switch=BACKPORT_ZMQ_SWITCH)
    if guard is not None or sign is not None:
        return Native(PARTIAL, "only one side of the ZMQ side-channel authentication is patched in",
                      [f"{ref.where}: {found}" for ref, found in ((init, guard), (receiver, sign)) if found])
    return Native(NO, "the rank port trusts every ZMQ frame (registrations, transfer infos, statuses, aborts)",
                  [init.where])
