"""``sglang-harden probe``: end-to-end isolation probes against a running endpoint.

Probes (each: pass | FAIL | not applicable | inconclusive, with the evidence):

- ``determinism``: the same greedy request, repeated with other traffic in between, must give the same output.
  The control that separates KV faults from sampling noise; when it fails, cross-tenant is inconclusive.
- ``oversize``: the shortest prompt each advertised limit forbids must be refused with a 4xx and an error,
  never answered with 200. SGLang's limits are exclusive (``len >= max_req_input_len`` and
  ``len >= context_length`` are refused), so that prompt is exactly ``limit`` tokens long.
- ``cross_tenant``: tenant A sends prompts of unique random tokens; tenant B sends the same greedy prompt
  near the limits (the smallest refused length when the limits differ -- the incident's window -- and the
  longest accepted one) without A's traffic and after different A's. B's output must not change with A's
  content and must not contain A's tokens.
- ``echo_canary``: markers at the start, middle and end of a long text prompt must be repeated when asked;
  "not applicable" when a short-prompt control already fails (a tiny or random model).

Prompts are sent as token ids (``input_ids`` / a token list for ``/v1/completions``) so lengths are exact.
Exit codes: 0 every probe passed or was not applicable; 1 a probe failed; 2 the target could not be probed
(unreachable, refused non-loopback target, budget exhausted before a verdict).
"""

from __future__ import annotations

import argparse
import ipaddress
import random
import secrets
import socket
import time
from dataclasses import asdict, dataclass, field

from sglang_harden.tools import audit
from sglang_harden.tools._endpoint import (
    Endpoint,
    NativeEndpoint,
    OpenAIEndpoint,
    Outcome,
    PairEndpoint,
    Prompt,
)
from sglang_harden.tools._http import (
    HttpError,
    add_client_arguments,
    configure,
    get_json,
    request,
    settings_from_args,
    split_url,
)
from sglang_harden.tools._render import dump_json, progress, table

EXIT_OK, EXIT_FAIL, EXIT_ERROR = 0, 1, 2
PASS, FAIL, NA, INCONCLUSIVE = "pass", "FAIL", "not applicable", "inconclusive"
GEN_TOKENS = 16

NON_LOOPBACK_HELP = (
    "allow a target that is not a loopback address. Off by default because the probe deliberately sends "
    "oversized prompts and other tenants' look-alike traffic: on a production service that is load you did "
    "not plan, and on a vulnerable build it can make another user's request read KV it does not own. Probe "
    "a staging copy; use this only for a deployment you are responsible for."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("url", nargs="?", help="router or server base URL (omit with --prefill/--decode)")
    parser.add_argument("--prefill", help="prefill server URL of a direct PD pair (no router)")
    parser.add_argument("--decode", help="decode server URL of a direct PD pair (no router)")
    parser.add_argument("--bootstrap-port", type=int, default=8998, help="prefill bootstrap port (default 8998)")
    parser.add_argument("--api", choices=("auto", "native", "openai"), default="auto", help="request format")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--allow-non-loopback", action="store_true", help=NON_LOOPBACK_HELP)
    parser.add_argument("--max-requests", type=int, default=60, help="upper bound on generate requests (60)")
    parser.add_argument("--time-budget", type=float, default=300.0, help="upper bound on wall time, s (300)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default 60)")
    parser.add_argument(
        "--limit", type=int, action="append", default=[], help="extra limit to probe: the shortest refused length"
    )
    parser.add_argument("--max-token-id", type=int, default=500, help="random prompt ids are < this (500)")
    parser.add_argument("--seed", type=int, help="seed for prompts (default: random)")
    parser.add_argument(
        "--probes",
        default="determinism,oversize,cross_tenant,echo_canary",
        help="comma-separated subset of determinism,oversize,cross_tenant,echo_canary",
    )
    add_client_arguments(parser)


class BudgetExhausted(Exception):
    pass


@dataclass
class Budget:
    max_requests: int
    deadline: float
    timeout_s: float
    used: int = 0

    def take(self) -> float:
        """Account for one request; return its timeout. Raises BudgetExhausted."""
        left = self.deadline - time.monotonic()
        if self.used >= self.max_requests:
            raise BudgetExhausted(f"request budget of {self.max_requests} used up")
        if left <= 1.0:
            raise BudgetExhausted("time budget used up")
        self.used += 1
        return min(self.timeout_s, left)


@dataclass
class ProbeResult:
    probe: str
    verdict: str
    summary: str
    evidence: list[str] = field(default_factory=list)


@dataclass
class Target:
    endpoint: Endpoint
    limits: dict[str, int]  # name -> max prompt tokens accepted
    notes: list[str] = field(default_factory=list)


class Prober:
    def __init__(self, target: Target, budget: Budget, rng: random.Random, max_token_id: int) -> None:
        self.target = target
        self.budget = budget
        self.rng = rng
        self.max_token_id = max(16, max_token_id)

    # -- plumbing
    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(5, self.max_token_id) for _ in range(max(1, n))]

    def send(self, label: str, prompt: Prompt, max_new_tokens: int = GEN_TOKENS) -> Outcome:
        timeout = self.budget.take()
        out = self.target.endpoint.generate(prompt, max_new_tokens, timeout)
        size = f"{len(prompt.ids)} ids" if prompt.ids is not None else f"{len(prompt.text or '')} chars"
        extra = f" [{out.detail}]" if out.detail else ""
        progress(f"{label} ({size}) -> {out.summary(40)}{extra} in {out.elapsed_s:.1f}s")
        return out

    @property
    def min_limit(self) -> int:
        return min(self.target.limits.values())

    @property
    def max_limit(self) -> int:
        return max(self.target.limits.values())

    # -- probes
    def determinism(self) -> ProbeResult:
        length = max(8, min(32, self.min_limit // 2))
        prompt = Prompt(ids=self.ids(length))
        outs = []
        for i in range(3):
            outs.append(self.send(f"determinism #{i + 1}", prompt))
            if i < 2:
                self.send("determinism: other traffic", Prompt(ids=self.ids(max(8, self.min_limit * 3 // 4))))
        if not all(o.ok for o in outs):
            bad = next(o for o in outs if not o.ok)
            return ProbeResult("determinism", INCONCLUSIVE, "a legitimate short request failed", [bad.summary()])
        distinct = {o.signature for o in outs}
        if len(distinct) == 1:
            return ProbeResult("determinism", PASS, f"3 repeats of a {length}-token greedy request identical")
        evidence = [f"repeat {i + 1}: {o.summary()}" for i, o in enumerate(outs)]
        return ProbeResult("determinism", FAIL, f"{len(distinct)} different outputs for one greedy request", evidence)

    def oversize(self) -> ProbeResult:
        failures, evidence = [], []
        for name, limit in sorted(self.target.limits.items(), key=lambda kv: kv[1])[:4]:
            out = self.send(f"oversize {name}", Prompt(ids=self.ids(limit)), max_new_tokens=4)
            line = f"{limit} tokens (refused from {name}={limit}): {out.summary()}"
            line += f" [{out.detail}]" if out.detail else ""
            evidence.append(line)
            if not (out.refused and out.error):
                failures.append(line)
        if failures:
            return ProbeResult("oversize", FAIL, "an oversized prompt was not refused with a 4xx", evidence)
        return ProbeResult("oversize", PASS, "every oversized prompt got a 4xx with an error", evidence)

    def cross_tenant(self, deterministic: bool | None) -> ProbeResult:
        lengths = [self.min_limit - 1]  # the longest prompt every node accepts
        if self.min_limit < self.max_limit:
            lengths.insert(0, self.min_limit)  # refused by the strictest node, accepted by another
        a_len = max(16, self.min_limit * 4 // 5)
        tenants = {"A1": self.ids(a_len), "A2": self.ids(a_len)}
        evidence: list[str] = []
        failed = False
        for b_len in lengths:
            verdict, lines = self._cross_tenant_at(b_len, tenants)
            evidence += lines
            failed |= verdict
        if failed and deterministic is False:
            return ProbeResult("cross_tenant", INCONCLUSIVE, "B varied, but so does a plain repeat", evidence)
        if failed:
            return ProbeResult("cross_tenant", FAIL, "tenant B's output depends on tenant A's traffic", evidence)
        return ProbeResult("cross_tenant", PASS, "B's output is independent of A's traffic", evidence)

    def _cross_tenant_at(self, b_len: int, tenants: dict[str, list[int]]) -> tuple[bool, list[str]]:
        b_prompt = Prompt(ids=self.ids(b_len))
        results: list[tuple[str, Outcome]] = []
        for before in ("none", "A1", "A2", "A1"):
            if before != "none":
                self.send(f"cross-tenant: tenant {before} plants markers", Prompt(ids=tenants[before]), 4)
            results.append((before, self.send(f"cross-tenant: B {b_len} tokens after {before}", b_prompt)))
        answered = [(b, o) for b, o in results if o.ok]
        lines = [f"B ({b_len} tokens) after {b}: {o.summary()}" for b, o in results]
        if not answered:
            return False, lines + [f"B ({b_len} tokens) was refused every time: nothing to leak"]
        leaked = [(b, o) for b, o in answered if _contains_marker(o.output_ids, tenants)]
        if leaked:
            lines.append(f"B's output contains a 4-gram of tenant A's tokens (after {leaked[0][0]})")
            return True, lines
        distinct = {o.signature for _, o in answered}
        if len(distinct) > 1:
            lines.append(f"B gave {len(distinct)} different greedy outputs depending on the traffic before it")
            return True, lines
        return False, lines

    def echo_canary(self) -> ProbeResult:
        marks = [f"QX{secrets.token_hex(3).upper()}" for _ in range(3)]
        control = self.send("echo canary: short control", Prompt(text=f"Repeat this code exactly: {marks[0]}\n"))
        if not control.ok or marks[0] not in (control.text or ""):
            return ProbeResult(
                "echo_canary", NA, "the model does not repeat a code even in a short prompt", [control.summary()]
            )
        budget_chars = max(200, int(self.min_limit * 0.8))
        filler = _filler(budget_chars - 200, self.rng)
        half = len(filler) // 2
        text = (
            f"Code one: {marks[0]}.\n{filler[:half]}\nCode two: {marks[1]}.\n{filler[half:]}\n"
            f"Code three: {marks[2]}.\nRepeat the three codes exactly: "
        )
        out = self.send("echo canary: long prompt", Prompt(text=text), max_new_tokens=32)
        missing = [m for m in marks if m not in (out.text or "")]
        if out.ok and not missing:
            return ProbeResult("echo_canary", PASS, "all three markers repeated", [out.summary()])
        return ProbeResult("echo_canary", FAIL, f"markers not repeated: {', '.join(missing)}", [out.summary()])


def _contains_marker(output_ids: list[int] | None, tenants: dict[str, list[int]], n: int = 4) -> bool:
    if not output_ids or len(output_ids) < n:
        return False
    grams = {tuple(ids[i : i + n]) for ids in tenants.values() for i in range(len(ids) - n + 1)}
    return any(tuple(output_ids[i : i + n]) in grams for i in range(len(output_ids) - n + 1))


def _filler(chars: int, rng: random.Random) -> str:
    words = ["river", "stone", "amber", "cloud", "field", "paper", "lemon", "orbit", "tiger", "maple"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(words))
    return " ".join(out)


# ---------------------------------------------------------------------------------------------- setup


def check_loopback(urls: list[str]) -> list[str]:
    """The URLs whose host resolves to anything but loopback addresses."""
    outside = []
    for url in urls:
        host = split_url(url)[1]
        try:
            addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
        except socket.gaierror:
            outside.append(url)
            continue
        if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
            outside.append(url)
    return outside


def discover_limits(urls: list[str], timeout_s: float, extra: list[int]) -> tuple[dict[str, int], list[str]]:
    """name -> the shortest prompt length that limit forbids (SGLang refuses ``len >= limit``)."""
    limits: dict[str, int] = {}
    notes: list[str] = []
    for url in urls:
        node = audit.audit_node(url, timeout_s, 8 << 20)
        if node.error:
            notes.append(f"limits of {url} unknown: {node.error}")
            continue
        role = node.role if node.role and node.role != "null" else "server"
        if node.max_req_input_len is not None:
            limits[f"{role}.max_req_input_len"] = node.max_req_input_len
        if node.context_length is not None:
            limits.setdefault("context_length", node.context_length)
    for i, value in enumerate(extra):
        limits[f"--limit#{i + 1}"] = value
    return limits, notes


def build_endpoint(args: argparse.Namespace, timeout_s: float) -> Endpoint:
    if args.prefill or args.decode:
        if not (args.prefill and args.decode):
            raise ValueError("--prefill and --decode go together")
        return PairEndpoint(args.prefill, args.decode, args.bootstrap_port)
    if not args.url:
        raise ValueError("give a URL, or --prefill URL --decode URL")
    if args.api == "native":
        return NativeEndpoint(args.url)
    model = _model_id(args.url, timeout_s)
    if args.api == "openai":
        if model is None:
            raise ValueError(f"{args.url}/v1/models names no model")
        return OpenAIEndpoint(args.url, model)
    resp = request(
        "POST",
        args.url.rstrip("/") + "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
        timeout_s=timeout_s,
    )
    if resp.status in (404, 405) and model is not None:
        return OpenAIEndpoint(args.url, model)
    return NativeEndpoint(args.url)


def _model_id(url: str, timeout_s: float) -> str | None:
    try:
        data = get_json(url.rstrip("/") + "/v1/models", timeout_s)
    except HttpError:
        return None
    entries = data.get("data") if isinstance(data, dict) else None
    if isinstance(entries, list) and entries and isinstance(entries[0], dict):
        model = entries[0].get("id")
        return model if isinstance(model, str) else None
    return None


# ---------------------------------------------------------------------------------------------- run


def run_probes(prober: Prober, wanted: list[str]) -> tuple[list[ProbeResult], str | None]:
    results: list[ProbeResult] = []
    deterministic: bool | None = None
    try:
        for name in ("determinism", "oversize", "cross_tenant", "echo_canary"):
            if name not in wanted:
                continue
            progress(f"probe {name}")
            if name == "cross_tenant":
                result = prober.cross_tenant(deterministic)
            else:
                result = getattr(prober, name)()
            if name == "determinism":
                deterministic = {PASS: True, FAIL: False}.get(result.verdict)
            results.append(result)
    except BudgetExhausted as exc:
        return results, str(exc)
    return results, None


def exit_code(results: list[ProbeResult], stopped: str | None) -> int:
    if any(r.verdict == FAIL for r in results):
        return EXIT_FAIL
    if stopped or not results:
        return EXIT_ERROR
    return EXIT_OK


def render_text(data: dict) -> str:
    lines = [f"target: {data['endpoint']} ({', '.join(data['urls'])})"]
    lines.append("limits: " + (", ".join(f"{k}={v}" for k, v in data["limits"].items()) or "none found"))
    lines += [f"note: {n}" for n in data["notes"]]
    rows = [[r["probe"], r["verdict"], r["summary"]] for r in data["results"]]
    lines += ["", table(["probe", "verdict", "summary"], rows, 80)]
    for r in data["results"]:
        if r["verdict"] in (FAIL, INCONCLUSIVE) or data.get("verbose"):
            lines += ["", f"{r['probe']} evidence:"] + [f"  {e}" for e in r["evidence"]]
    if data["stopped"]:
        lines += ["", f"stopped early: {data['stopped']}"]
    lines += ["", f"{data['requests']} requests in {data['elapsed_s']}s; exit {data['exit_code']}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    start = time.monotonic()
    timeout = max(1.0, float(args.timeout))
    urls = [u for u in (args.url, args.prefill, args.decode) if u]
    if not urls:
        print("probe: give a URL, or --prefill URL --decode URL")
        return EXIT_ERROR
    try:
        configure(settings_from_args(args))
    except ValueError as exc:
        print(f"probe: {exc}")
        return EXIT_ERROR
    try:
        outside = check_loopback(urls)
    except HttpError as exc:
        print(f"probe: {exc}")
        return EXIT_ERROR
    if outside and not args.allow_non_loopback:
        print(f"probe: refusing non-loopback target(s) {', '.join(outside)}; see --allow-non-loopback in --help")
        return EXIT_ERROR
    try:
        endpoint = build_endpoint(args, timeout)
    except (ValueError, HttpError) as exc:
        print(f"probe: {exc}")
        return EXIT_ERROR
    limits, notes = discover_limits(endpoint.urls(), timeout, args.limit)
    if not limits:
        print("probe: no prompt limit advertised by the target; pass --limit N\n" + "\n".join(notes))
        return EXIT_ERROR
    seed = args.seed if args.seed is not None else secrets.randbits(32)
    budget = Budget(max(1, args.max_requests), start + max(5.0, args.time_budget), timeout)
    prober = Prober(Target(endpoint, limits, notes), budget, random.Random(seed), args.max_token_id)
    wanted = [p.strip() for p in args.probes.split(",") if p.strip()]
    results, stopped = run_probes(prober, wanted)
    code = exit_code(results, stopped)
    data = {
        "endpoint": endpoint.name,
        "urls": endpoint.urls(),
        "limits": limits,
        "notes": notes,
        "seed": seed,
        "results": [asdict(r) for r in results],
        "stopped": stopped,
        "requests": budget.used,
        "elapsed_s": round(time.monotonic() - start, 1),
        "exit_code": code,
    }
    print(dump_json(data) if args.json else render_text(data))
    return code
