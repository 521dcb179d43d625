"""``sglang-harden audit URL...``: are the running nodes sized and guarded so a request only reads its own KV?

Per node it reads ``/server_info`` (``/get_server_info`` on pins before 0.5.6), ``/v1/models`` and ``/metrics``
and reports role, context length, KV pool tokens, ``max_req_input_len``, transfer backend and the sglang-harden
guard counters (``sglang_harden_guard_decisions_total``). Findings:

- ``pool_below_context``: a node's KV pool holds fewer tokens than its advertised context;
- ``prefill_limit_below_decode``: a prefill node accepts shorter prompts than a decode node (the incident's
  precondition: a prompt between the two limits is rejected by prefill but reserved by decode);
- ``prompt_limit_unservable``: a PD node advertises prompts (``< max_req_input_len``) its pool can never admit
  once paging and decode's reserved tokens are counted (``guards.capacity.largest_servable_prompt``); such a
  prompt is neither served nor refused by vanilla SGLang, it waits until the PD waiting timeout (issue 40 (a); the
  hardened doors refuse it at once);
- ``guards_missing``: neither an sglang-harden report in server info (``internal_states[i].sglang_harden``:
  armed guards and decision counts) nor guard decisions on ``/metrics``;
- ``control_plane_unauthenticated``: a hardened PD node reports that its control plane (the bootstrap routes)
  is not authenticated (no ``--harden-bootstrap-secret-file``), or only logs failed tokens;
- ``side_channels_unauthenticated``: a hardened PD node reports that its ZMQ side channels (the KV managers' rank
  ports: registrations, transfer infos, statuses, aborts, drain acks) are not authenticated (no secret file, or
  ``zmq_auth`` off or log).

Nodes: URLs on the command line and in ``--fleet`` files. ``--api-key-file`` (a fleet started with SGLang's
``--api-key``), ``--header``, ``--cacert`` and ``--insecure`` apply to every request; an error names its node.

Exit codes (a deploy gate): 0 every node audited, no findings (except those named with ``--ignore``);
1 findings; 2 at least one node could not be audited (unreachable, timed out, malformed answer) -- this wins
over 1, since the set was not fully checked.
"""

from __future__ import annotations

import argparse
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_harden.events import METRIC_NAME
from sglang_harden.guards.capacity import SGLANG_MARGIN, largest_advertised_prompt, largest_servable_prompt
from sglang_harden.tools._http import (
    HttpError,
    add_client_arguments,
    configure,
    credentials_hint,
    get_json,
    request,
    settings_from_args,
)
from sglang_harden.tools._render import dump_json, table

EXIT_OK, EXIT_FINDINGS, EXIT_UNAUDITED = 0, 1, 2
SAMPLE_RE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
FINDING_CODES = ("pool_below_context", "prefill_limit_below_decode", "prompt_limit_unservable", "guards_missing",
                 "control_plane_unauthenticated", "side_channels_unauthenticated")
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("urls", nargs="*", metavar="URL", help="SGLang server base URLs (prefill and decode)")
    parser.add_argument("--fleet", type=_fleet_file, action="append", default=[], metavar="FILE",
                        help="read more URLs from FILE: one per line, '#' starts a comment (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="S", help="seconds per HTTP request (default 10)"
    )
    parser.add_argument("--max-bytes", type=int, default=8 << 20, help="cap on bytes read per response (default 8 MiB)")
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="CODE",
        choices=FINDING_CODES,
        help="do not gate on this finding (still printed), e.g. guards_missing on a fleet without the plugin",
    )
    add_client_arguments(parser)


def _fleet_file(path: str) -> list[str]:
    """The URLs listed in a fleet file; argparse reports a file it cannot read or a line that is not a URL."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read fleet file {path}: {exc}") from None
    urls = []
    for number, line in enumerate(lines, 1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        if " " in entry or not entry.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"{path}:{number}: not an http(s) URL: {entry!r}")
        urls.append(entry)
    return urls


@dataclass
class Node:
    url: str
    error: str | None = None
    role: str | None = None
    version: str | None = None
    context_length: int | None = None
    pool_tokens: int | None = None
    max_req_input_len: int | None = None
    page_size: int | None = None
    reserved_decode_tokens: int | None = None  # decode's --num-reserved-decode-tokens
    transfer_backend: str | None = None
    metrics: str = "unknown"  # "ok" | "unavailable: ..." | "unknown"
    guards: dict[str, dict[str, float]] = field(default_factory=dict)
    armed_guards: list[str] = field(default_factory=list)  # from /server_info internal_states[].sglang_harden
    control_plane_auth: str | None = None  # enforce | log | unauthenticated (None: not reported)
    side_channel_auth: str | None = None  # enforce | log | off | unauthenticated [(not signing)] (None: not reported)
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Finding:
    code: str
    node: str
    message: str


# ---------------------------------------------------------------------------------------------- fetch


def audit_node(url: str, timeout_s: float, max_bytes: int) -> Node:
    node = Node(url=url.rstrip("/"))
    try:
        info = _server_info(node.url, timeout_s, max_bytes)
    except HttpError as exc:
        node.error = str(exc)
        return node
    if not isinstance(info, dict):
        node.error = f"{node.url}: server info is a JSON {type(info).__name__}, not an object"
        return node
    _fill_from_info(node, info)
    _fill_from_models(node, timeout_s, max_bytes)
    _fill_from_metrics(node, timeout_s, max_bytes)
    if node.context_length is None and node.max_req_input_len is None and node.pool_tokens is None:
        node.error = f"{node.url}: server info has none of context_length, max_total_num_tokens, max_req_input_len"
    return node


def _server_info(url: str, timeout_s: float, max_bytes: int) -> Any:
    resp = request("GET", url + "/server_info", timeout_s=timeout_s, max_bytes=max_bytes)
    if resp.status in (404, 405):
        resp = request("GET", url + "/get_server_info", timeout_s=timeout_s, max_bytes=max_bytes)
    if not resp.ok:
        raise HttpError(f"{url}: server info answered HTTP {resp.status}{credentials_hint(resp.status)}: "
                        f"{resp.text(120)!r}")
    return resp.json()


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _first_int(node: Node, info: dict, keys: tuple[str, ...]) -> int | None:
    for key in keys:
        if key in info and info[key] is not None:
            value = _int(info[key])
            if value is None:
                node.warnings.append(f"{key} is not an integer: {str(info[key])[:40]!r}")
            return value
    return None


def _fill_from_info(node: Node, info: dict) -> None:
    role = info.get("disaggregation_mode")
    node.role = role if isinstance(role, str) else ("null" if role is None else str(role)[:20])
    version = info.get("version")
    node.version = version if isinstance(version, str) else None
    node.context_length = _first_int(node, info, ("context_length", "context_len"))
    node.pool_tokens = _first_int(node, info, ("max_total_num_tokens",)) or _pool_from_states(info)
    node.max_req_input_len = _first_int(node, info, ("max_req_input_len",))
    node.page_size = _first_int(node, info, ("page_size",))
    node.reserved_decode_tokens = _first_int(node, info, ("num_reserved_decode_tokens",))
    backend = info.get("disaggregation_transfer_backend")
    node.transfer_backend = backend if isinstance(backend, str) else None
    _fill_harden_report(node, info)


def _fill_harden_report(node: Node, info: dict) -> None:
    """sglang-harden adds ``internal_states[i].sglang_harden`` (armed guards, decision counts) to server info."""
    states = info.get("internal_states")
    if not isinstance(states, list):
        return
    for state in states:
        report = state.get("sglang_harden") if isinstance(state, dict) else None
        if not isinstance(report, dict):
            continue
        auth = report.get("control_plane_auth")
        if isinstance(auth, str):
            node.control_plane_auth = auth
        side = report.get("side_channel_auth")
        if isinstance(side, str):
            node.side_channel_auth = side
        guards = report.get("guards")
        if isinstance(guards, list):
            node.armed_guards = sorted({*node.armed_guards, *(str(g) for g in guards)})
        decisions = report.get("decisions")
        if isinstance(decisions, dict):
            for key, count in decisions.items():
                guard, _, decision = str(key).partition(":")
                value = _int(count)
                if value is not None and decision:
                    node.guards.setdefault(guard, {})
                    node.guards[guard][decision] = node.guards[guard].get(decision, 0) + value


def _pool_from_states(info: dict) -> int | None:
    states = info.get("internal_states")
    if not isinstance(states, list):
        return None
    caps = [
        _int(s.get("memory_usage", {}).get("token_capacity"))
        for s in states
        if isinstance(s, dict) and isinstance(s.get("memory_usage"), dict)
    ]
    caps = [c for c in caps if c is not None]
    return min(caps) if caps else None


def _fill_from_models(node: Node, timeout_s: float, max_bytes: int) -> None:
    try:
        models = get_json(node.url + "/v1/models", timeout_s, max_bytes)
    except HttpError as exc:
        node.warnings.append(f"/v1/models: {exc}")
        return
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        node.warnings.append("/v1/models: no model entries")
        return
    max_len = _int(data[0].get("max_model_len"))
    if node.context_length is None:
        node.context_length = max_len
    elif max_len is not None and max_len != node.context_length:
        node.warnings.append(f"/v1/models max_model_len {max_len} != context_length {node.context_length}")


def _fill_from_metrics(node: Node, timeout_s: float, max_bytes: int) -> None:
    try:
        resp = request("GET", node.url + "/metrics", timeout_s=timeout_s, max_bytes=max_bytes)
    except HttpError as exc:
        node.metrics = f"unavailable: {exc}"
        return
    if not resp.ok:
        node.metrics = f"unavailable: HTTP {resp.status} (start the server with --enable-metrics)"
        return
    node.metrics = "ok"
    counters = parse_guard_counters(resp.body.decode("utf-8", errors="replace"))
    if counters:
        node.guards = counters  # the live counters of every process win over the scheduler snapshot


def parse_guard_counters(text: str) -> dict[str, dict[str, float]]:
    """{guard: {decision: count}} from Prometheus text; malformed lines are skipped."""
    wanted = {f"{METRIC_NAME}_total", METRIC_NAME}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = SAMPLE_RE.match(line)
        if match is None or match.group("name") not in wanted:
            continue
        labels = dict(LABEL_RE.findall(match.group("labels") or ""))
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        guard, decision = labels.get("guard"), labels.get("decision")
        if guard and decision:
            out.setdefault(guard, {})
            out[guard][decision] = out[guard].get(decision, 0.0) + value
    return out


# ---------------------------------------------------------------------------------------------- judge


def findings(nodes: list[Node]) -> list[Finding]:
    out: list[Finding] = []
    audited = [n for n in nodes if n.error is None]
    for node in audited:
        if node.pool_tokens is not None and node.context_length is not None:
            if node.pool_tokens < node.context_length:
                out.append(
                    Finding(
                        "pool_below_context",
                        node.url,
                        f"KV pool holds {node.pool_tokens} tokens < context length {node.context_length}; "
                        f"prompts must be shorter than {node.max_req_input_len} (raise --max-total-tokens / "
                        "--mem-fraction-static or lower --context-length)",
                    )
                )
        unservable = _unservable_limit(node)
        if unservable is not None:
            out.append(unservable)
        if node.role in ("prefill", "decode") and node.control_plane_auth in ("unauthenticated", "log"):
            out.append(Finding("control_plane_unauthenticated", node.url,
                               f"control plane {node.control_plane_auth}: anyone who reaches the bootstrap port can "
                               "register KV routes and post abort notices (set --harden-bootstrap-secret-file; "
                               "docs/security.md)"))
        side = (node.side_channel_auth or "").split(" ")[0]
        if node.role in ("prefill", "decode") and side in ("unauthenticated", "log", "off"):
            out.append(Finding("side_channels_unauthenticated", node.url,
                               f"ZMQ side channels {node.side_channel_auth}: anyone who reaches a KV manager's rank "
                               "port can register destinations, redirect or copy KV transfers and stop the listener "
                               "threads (set --harden-bootstrap-secret-file, zmq_auth enforce; docs/security.md)"))
        if node.armed_guards or node.guards:
            continue
        if node.metrics != "ok":
            why = f"no sglang-harden report in server info, and /metrics {node.metrics}"
        else:
            why = f"no sglang-harden report in server info and no {METRIC_NAME}_total samples: guards not active"
        out.append(Finding("guards_missing", node.url, why))
    out += _limit_asymmetry(audited)
    return out


def _unservable_limit(node: Node) -> Finding | None:
    """A PD node whose advertised prompt limit its pool cannot serve (needs page size, and decode's reserve)."""
    if node.role not in ("prefill", "decode") or node.page_size is None or node.page_size < 1:
        return None
    if node.pool_tokens is None or node.max_req_input_len is None:
        return None
    if node.role == "decode" and node.reserved_decode_tokens is None:
        return None
    reserved = (node.reserved_decode_tokens or 0) if node.role == "decode" else 0
    servable = largest_servable_prompt(node.role, node.pool_tokens, node.page_size, reserved)
    advertised = largest_advertised_prompt(node.max_req_input_len)
    if servable is None or advertised <= servable:
        return None
    reserve = f" and {reserved} reserved decode tokens" if node.role == "decode" else ""
    return Finding(
        "prompt_limit_unservable",
        node.url,
        f"{node.role} accepts prompts up to {advertised} tokens (max_req_input_len {node.max_req_input_len}) but "
        f"its pool of {node.pool_tokens} tokens with page size {node.page_size}{reserve} serves at most "
        f"{servable}: a prompt of {servable + 1}..{advertised} tokens waits until the PD waiting timeout (raise "
        f"--max-total-tokens / --mem-fraction-static or lower --context-length to {servable + 1 + SGLANG_MARGIN}; a "
        "hardened node refuses such a prompt at once with 400)",
    )


def _limit_asymmetry(nodes: list[Node]) -> list[Finding]:
    prefill = [n for n in nodes if n.role == "prefill" and n.max_req_input_len is not None]
    decode = [n for n in nodes if n.role == "decode" and n.max_req_input_len is not None]
    if not prefill or not decode:
        return []
    low = min(prefill, key=lambda n: n.max_req_input_len or 0)
    high = max(decode, key=lambda n: n.max_req_input_len or 0)
    assert low.max_req_input_len is not None and high.max_req_input_len is not None
    if low.max_req_input_len >= high.max_req_input_len:
        return []
    return [
        Finding(
            "prefill_limit_below_decode",
            low.url,
            f"prefill max_req_input_len {low.max_req_input_len} < decode {high.url} max_req_input_len "
            f"{high.max_req_input_len}: a prompt of {low.max_req_input_len}..{high.max_req_input_len - 1} tokens "
            "is refused by prefill and reserved by decode (the incident's precondition)",
        )
    ]


def exit_code(nodes: list[Node], found: list[Finding], ignored: tuple[str, ...] = ()) -> int:
    if any(n.error for n in nodes):
        return EXIT_UNAUDITED
    return EXIT_FINDINGS if any(f.code not in ignored for f in found) else EXIT_OK


# ---------------------------------------------------------------------------------------------- output


def _guards_cell(node: Node) -> str:
    if not node.guards and not node.armed_guards:
        return "none" if node.metrics == "ok" else "none seen (no /metrics)"
    parts = [f"armed: {','.join(node.armed_guards)}"] if node.armed_guards else []
    for guard, decisions in sorted(node.guards.items()):
        counts = ",".join(f"{d}={int(v)}" for d, v in sorted(decisions.items()))
        parts.append(f"{guard}[{counts}]")
    return " ".join(parts)


def render_text(nodes: list[Node], found: list[Finding], code: int, ignored: tuple[str, ...] = ()) -> str:
    rows = [
        [
            n.url,
            n.role,
            n.context_length,
            n.pool_tokens,
            n.max_req_input_len,
            n.transfer_backend,
            n.control_plane_auth or "-",
            n.side_channel_auth or "-",
            "ERROR" if n.error else _guards_cell(n),
        ]
        for n in nodes
    ]
    headers = ["node", "role", "context", "pool tokens", "max_req_input_len", "backend", "control plane",
               "side channels", "guards"]
    lines = [table(headers, rows, 90)]
    errors = [n for n in nodes if n.error]
    if errors:
        lines += ["", "could not audit:"] + [f"  {n.url}: {n.error}" for n in errors]
    warnings = [(n.url, w) for n in nodes for w in n.warnings]
    if warnings:
        lines += ["", "warnings:"] + [f"  {u}: {w}" for u, w in warnings]
    if found:
        lines += ["", "findings:"] + [f"  [{f.code}] {f.node}: {f.message}" for f in found]
    if ignored:
        lines.append(f"  (not gating on: {', '.join(ignored)})")
    verdict = {EXIT_OK: "OK", EXIT_FINDINGS: "FINDINGS", EXIT_UNAUDITED: "INCOMPLETE"}[code]
    lines += ["", f"{verdict} (exit {code})"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    timeout = max(0.1, float(args.timeout))
    urls = list(dict.fromkeys([*args.urls, *(url for listed in args.fleet for url in listed)]))
    if not urls:
        print("audit: give node URLs, or --fleet FILE", file=sys.stderr)
        return EXIT_UNAUDITED
    try:
        configure(settings_from_args(args))
    except ValueError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return EXIT_UNAUDITED
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        nodes = list(pool.map(lambda u: _safe_audit(u, timeout, args.max_bytes), urls))
    found = findings(nodes)
    code = exit_code(nodes, found, tuple(args.ignore))
    if args.json:
        payload = {
            "nodes": [asdict(n) for n in nodes],
            "findings": [asdict(f) for f in found],
            "exit_code": code,
        }
        print(dump_json(payload))
    else:
        print(render_text(nodes, found, code, tuple(args.ignore)))
    return code


def _safe_audit(url: str, timeout_s: float, max_bytes: int) -> Node:
    try:
        return audit_node(url, timeout_s, max_bytes)
    except Exception as exc:  # noqa: BLE001 - one bad node must not stop the others
        return Node(url=url, error=f"{url}: unexpected {type(exc).__name__}: {exc}")
