"""Soak requests on the wire: where they go (``Target``), one request sent (``send``), the forged control-plane
requests of a caller without the secret, and each server's pool numbers (``pool_of``)."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from sglang_harden.testbed.client import generate, http_json
from sglang_harden.testbed.pd_topology import PDFleet, PDPair


class Target:
    """Where requests go: a prefill and a decode URL (requests paired directly) or a router URL; ``nodes`` names
    every server (``prefill``/``decode``, or ``prefill0``, ``decode1``, ... in a fleet) for polling and aborts."""

    def __init__(self, nodes: dict[str, str], bootstrap_port: int, router_url: str | None = None,
                 bootstrap_ports: list[int] | None = None):
        self.nodes, self.bootstrap_port, self.router_url = dict(nodes), bootstrap_port, router_url
        self.bootstrap_ports = list(bootstrap_ports or [bootstrap_port])
        self.prefill_url = next(url for name, url in self.nodes.items() if name.startswith("prefill"))
        self.decode_url = next(url for name, url in self.nodes.items() if name.startswith("decode"))

    @classmethod
    def of_pair(cls, pair: PDPair) -> Target:
        assert pair.prefill.bootstrap_port is not None
        router = pair.router.url if pair.router is not None else None
        return cls({"prefill": pair.prefill.url, "decode": pair.decode.url}, pair.prefill.bootstrap_port, router)

    @classmethod
    def of_fleet(cls, fleet: PDFleet) -> Target:
        nodes = {f"prefill{i}": s.url for i, s in enumerate(fleet.prefills)}
        nodes.update({f"decode{i}": s.url for i, s in enumerate(fleet.decodes)})
        ports = [int(s.bootstrap_port or 0) for s in fleet.prefills]
        return cls(nodes, ports[0], fleet.router.url, ports)

    @classmethod
    def of_state(cls, state: dict[str, Any]) -> Target:
        router = (state.get("router") or {}).get("url")
        nodes = {"prefill": state["prefill"]["url"], "decode": state["decode"]["url"]}
        return cls(nodes, int(state["prefill"]["bootstrap_port"]), router)

    def abort(self, rid: str) -> None:
        for url in self.nodes.values():
            try:
                http_json("POST", url + "/abort_request", {"rid": rid}, timeout=10.0)
            except OSError:
                pass


def _stream(url: str, body: dict[str, Any], timeout: float) -> tuple[int, float | None, dict[str, Any], str]:
    """POST a streaming /generate; (status, time to first chunk, last chunk's meta_info, error text)."""
    start = time.monotonic()
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    ttft, meta = None, {}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return _status_of(chunk), ttft, meta, str(chunk["error"])[:200]
                ttft = time.monotonic() - start if ttft is None else ttft
                meta = chunk.get("meta_info") or meta
        return _finish_status(meta), ttft, meta, _finish_message(meta)
    except urllib.error.HTTPError as exc:
        return exc.code, ttft, meta, exc.read()[:200].decode(errors="replace")
    except (TimeoutError, urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
        return -1, ttft, meta, repr(exc)[:200]


def _status_of(chunk: dict[str, Any]) -> int:
    err = chunk.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    return int(code) if isinstance(code, int) else 500


def _finish_status(meta: dict[str, Any]) -> int:
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return int(finish.get("status_code") or 500)
    return 200


def _finish_message(meta: dict[str, Any]) -> str:
    finish = meta.get("finish_reason") or {}
    return str(finish.get("message") or "")[:200] if isinstance(finish, dict) else ""


def send(target: Target, body: dict[str, Any], timeout: float, room: int | None = None
         ) -> tuple[int, float | None, int, str]:
    """One request (paired directly, or through the router); the decode side streams. Returns (status, ttft,
    generated tokens, error). Status is the worse of the two halves when paired directly."""
    if target.router_url is not None:
        status, ttft, meta, err = _stream(target.router_url, body, timeout)
        return status, ttft, int(meta.get("completion_tokens") or 0), err
    room = random.randrange(2**62) if room is None else room
    paired = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": target.bootstrap_port, "bootstrap_room": room}
    box: dict[str, int] = {}
    side = threading.Thread(target=lambda: box.update(p=generate(target.prefill_url, paired, timeout).status))
    side.start()
    status, ttft, meta, err = _stream(target.decode_url, paired, timeout)
    side.join()
    prefill = box.get("p", -1)
    if status == 200 and prefill != 200:
        status, err = prefill, err or f"prefill answered {prefill}"
    return status, ttft, int(meta.get("completion_tokens") or 0), err


ROUTE_TABLE_QUERY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
FORGED_ROUTES = ("PUT /pd_rejections", "PUT /sglang_harden/digest", "GET /sglang_harden/digest_feed",
                 "GET /sglang_harden/aborts", "GET /route")


def forge_control_requests(port: int, room: int) -> list[tuple[str, int]]:
    """Forged control requests (no token) at one bootstrap port: (route, HTTP status) each; -1 unreachable. None
    changes a vanilla server's routes: the writes go to sglang-harden's routes, which vanilla has not got."""
    abort = {"room": room, "status_code": 400, "message": "forged by the soak", "sent_kv": False}
    digest = {"room": room, "rank": 0, "values": [0] * 8}
    calls = [("PUT", "/pd_rejections", abort), ("PUT", "/sglang_harden/digest", digest),
             ("GET", "/sglang_harden/digest_feed?since=0&epoch=&wait_ms=0", None),
             ("GET", f"/pd_rejections?rooms={room}", None), ("GET", ROUTE_TABLE_QUERY, None)]
    out = []
    for (method, target, body), route in zip(calls, FORGED_ROUTES, strict=True):
        try:
            status, _ = http_json(method, f"http://127.0.0.1:{port}{target}", body, timeout=10.0)
        except OSError:
            status = -1
        out.append((route, int(status)))
    return out


def pool_of(url: str) -> dict[str, Any]:
    """The first scheduler's testbed pool numbers and sglang-harden report (empty dict when unreachable)."""
    try:
        status, body = http_json("GET", url + "/server_info", timeout=10.0)
    except OSError:
        return {}
    if status != 200 or not isinstance(body, dict):
        return {}
    state = (body.get("internal_states") or [{}])[0] or {}
    harden = state.get("sglang_harden") if isinstance(state.get("sglang_harden"), dict) else {}
    return {"pool": state.get("testbed_pool") or {}, "lifecycle": harden.get("lifecycle") or {},
            "decisions": dict(harden.get("decisions") or {})}
