"""PD topologies started and stopped as one unit: a prefill+decode pair, optionally behind sglang-router
(``PDPair``), and several of each behind sglang-router (``PDFleet``)."""

from __future__ import annotations

import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from sglang_harden.testbed import procs
from sglang_harden.testbed.client import PairResult, pd_generate
from sglang_harden.testbed.profiles import Profile, default_profile
from sglang_harden.testbed.router import Router
from sglang_harden.testbed.server import VANILLA_LAUNCHER, PortTaken, Server, ServerError, _Process


def _progress(msg: str) -> None:
    print(f"[testbed] {msg}", file=sys.stderr, flush=True)


class PDPair:
    """A prefill server and a decode server for one pin (and optionally sglang-router), as one unit.

    ``with PDPair(pin, prefill_max_total_tokens=256, decode_max_total_tokens=400) as pair:`` starts both
    servers concurrently, waits for both, and stops both (and the router) on exit, also when a start fails.
    """

    def __init__(
        self,
        pin: str,
        *,
        prefill_max_total_tokens: int,
        decode_max_total_tokens: int,
        context_length: int = 512,
        transfer_backend: str = "mooncake",
        num_reserved_decode_tokens: int | None = 32,
        profile: Profile | None = None,
        prefill_flags: Sequence[str] = (),
        decode_flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        prefill_env: Mapping[str, str] | None = None,
        decode_env: Mapping[str, str] | None = None,
        launcher_module: str = VANILLA_LAUNCHER,
        router: bool = False,
        log_dir: Path | None = None,
        startup_timeout: float = 600.0,
        progress: bool = False,
        python: Path | None = None,
        model_path: Path | None = None,
    ) -> None:
        """``python``: the interpreter both servers run (default: the pin's venv), e.g. a built image's;
        ``model_path``: the model both serve (default: the tiny Llama)."""
        self.pin = pin
        self.profile = profile or default_profile()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"sglang-harden-pd-{pin}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.progress = progress
        common: dict[str, Any] = dict(
            context_length=context_length,
            transfer_backend=transfer_backend,
            profile=self.profile,
            launcher_module=launcher_module,
            log_dir=self.log_dir,
            startup_timeout=startup_timeout,
            python=python,
            model_path=model_path,
        )
        self.prefill = Server(
            pin,
            "prefill",
            max_total_tokens=prefill_max_total_tokens,
            extra_flags=prefill_flags,
            env={**(env or {}), **(prefill_env or {})},
            **common,
        )
        self.decode = Server(
            pin,
            "decode",
            max_total_tokens=decode_max_total_tokens,
            num_reserved_decode_tokens=num_reserved_decode_tokens,
            extra_flags=decode_flags,
            env={**(env or {}), **(decode_env or {})},
            **common,
        )
        self.router: Router | None = Router(pin, self.prefill, self.decode, self.log_dir) if router else None

    def _say(self, msg: str) -> None:
        if self.progress:
            _progress(f"{self.pin}: {msg}")

    def start(self, port_retries: int = 2) -> PDPair:
        """Start both servers (concurrently), wait for both, then the router; stop everything on failure.

        When a server finds one of its ports taken while it boots, the pair is started again on fresh ports.
        """
        for _ in range(port_retries):
            try:
                return self._start_once()
            except PortTaken as exc:
                self._say(f"port taken, starting again on fresh ports: {str(exc).splitlines()[0]}")
                for part in self.parts():
                    part.reset()
        return self._start_once()

    def _start_once(self) -> PDPair:
        try:
            self._say(f"starting prefill :{self.prefill.port} and decode :{self.decode.port} (logs {self.log_dir})")
            self.prefill.start()
            self.decode.start()
            _wait_all([self.prefill, self.decode],
                      lambda server: self._say(f"{server.role} ready in {server.ready_s:.1f} s"))
            if self.router is not None:
                self._say(f"starting sglang-router :{self.router.port}")
                self.router.start().wait_ready()
                self._say(f"router ready in {self.router.ready_s:.1f} s")
        except BaseException:
            self.stop(term_timeout=3.0)
            raise
        return self

    def stop(self, term_timeout: float = 10.0) -> None:
        """Stop the router and both servers (their groups are signalled together)."""
        stop_together([p for p in (self.router, self.prefill, self.decode) if p is not None], term_timeout)

    def wait_quiesced(self, timeout: float = 10.0) -> dict[str, dict[str, Any]]:
        """Both allocators back to full capacity (each polled up to ``timeout``): ``{role: pool numbers}``."""
        return {s.role: s.wait_pool_full(timeout) for s in (self.prefill, self.decode)}

    def parts(self) -> list[_Process]:
        return [p for p in (self.prefill, self.decode, self.router) if p is not None]

    def detach(self) -> None:
        for part in self.parts():
            part.detach()

    def describe(self) -> dict[str, Any]:
        """JSON-able description (urls, ports, pids, logs) of a started pair."""
        out: dict[str, Any] = {"pin": self.pin, "profile": self.profile.name, "log_dir": str(self.log_dir)}
        for part in self.parts():
            role = getattr(part, "role", "router")
            out[role] = {
                "url": part.url,
                "pgid": part.pid,
                "start_ticks": procs.start_ticks(part.pid) if part.pid else None,
                "log": str(part.log_path),
                "ready_s": None if part.ready_s is None else round(part.ready_s, 1),
            }
            if getattr(part, "bootstrap_port", None):
                out[role]["bootstrap_port"] = part.bootstrap_port
        return out

    def generate(
        self,
        body: dict[str, Any],
        room: int | None = None,
        timeout: float = 120.0,
        prefill_body: dict[str, Any] | None = None,
    ) -> PairResult:
        """One PD request sent directly to both servers (same body + bootstrap fields; see ``pd_generate``)."""
        assert self.prefill.bootstrap_port is not None
        return pd_generate(
            self.prefill.url, self.decode.url, self.prefill.bootstrap_port, body, room=room, timeout=timeout,
            prefill_body=prefill_body,
        )

    def generate_via_router(self, body: dict[str, Any], timeout: float = 120.0) -> Any:
        if self.router is None:
            raise ServerError("this pair was started without a router")
        return self.router.generate(body, timeout)

    def __enter__(self) -> PDPair:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class PDFleet:
    """Several prefill and decode servers of one pin behind sglang-router in PD mode (e.g. 2P/2D), as one unit.

    Every server gets the same sizes; each prefill its own bootstrap port. The router picks a prefill and a
    decode per request (round robin). Started and stopped like :class:`PDPair`.
    """

    def __init__(
        self,
        pin: str,
        *,
        prefills: int = 2,
        decodes: int = 2,
        prefill_max_total_tokens: int,
        decode_max_total_tokens: int,
        context_length: int = 512,
        transfer_backend: str = "mooncake",
        num_reserved_decode_tokens: int | None = 32,
        profile: Profile | None = None,
        env: Mapping[str, str] | None = None,
        prefill_env: Mapping[str, str] | None = None,
        decode_env: Mapping[str, str] | None = None,
        launcher_module: str = VANILLA_LAUNCHER,
        log_dir: Path | None = None,
        startup_timeout: float = 900.0,
        progress: bool = False,
    ) -> None:
        if prefills < 1 or decodes < 1:
            raise ServerError(f"a fleet needs at least one prefill and one decode (got {prefills}P/{decodes}D)")
        self.pin, self.progress = pin, progress
        self.profile = profile or default_profile()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"sglang-harden-fleet-{pin}-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        common: dict[str, Any] = dict(
            context_length=context_length, transfer_backend=transfer_backend, profile=self.profile,
            launcher_module=launcher_module, log_dir=self.log_dir, startup_timeout=startup_timeout,
        )
        self.prefills = [
            Server(pin, "prefill", max_total_tokens=prefill_max_total_tokens, name=f"prefill{i}-{pin}",
                   env={**(env or {}), **(prefill_env or {})}, **common)
            for i in range(prefills)
        ]
        self.decodes = [
            Server(pin, "decode", max_total_tokens=decode_max_total_tokens, name=f"decode{i}-{pin}",
                   num_reserved_decode_tokens=num_reserved_decode_tokens,
                   env={**(env or {}), **(decode_env or {})}, **common)
            for i in range(decodes)
        ]
        self.router = Router(pin, self.prefills, self.decodes, self.log_dir)

    @property
    def servers(self) -> list[Server]:
        return [*self.prefills, *self.decodes]

    def parts(self) -> list[_Process]:
        return [*self.servers, self.router]

    def start(self) -> PDFleet:
        """Start every server at once, wait for all, then the router; stop everything on any failure."""
        try:
            if self.progress:
                _progress(f"{self.pin}: starting {len(self.prefills)}P/{len(self.decodes)}D (logs {self.log_dir})")
            for server in self.servers:
                server.start()
            _wait_all(self.servers)
            self.router.start().wait_ready()
            if self.progress:
                _progress(f"{self.pin}: fleet ready behind sglang-router :{self.router.port}")
        except BaseException:
            self.stop(term_timeout=3.0)
            raise
        return self

    def stop(self, term_timeout: float = 10.0) -> None:
        stop_together(self.parts(), term_timeout)

    def __enter__(self) -> PDFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_all(servers: Sequence[Server], on_ready: Callable[[Server], None] | None = None) -> None:
    """Wait for every (started) server at once; raise the first failure after all have settled."""
    errors: list[BaseException] = []

    def wait(server: Server) -> None:
        try:
            server.wait_ready()
            if on_ready is not None:
                on_ready(server)
        except BaseException as exc:  # raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def stop_together(parts: Sequence[_Process], term_timeout: float = 10.0) -> None:
    """Signal the process groups of every started part together (each SGLang server waits seconds after SIGTERM:
    one after another, a module's pairs took tens of seconds to stop); raise if one survives SIGKILL."""
    started = [p for p in parts if p.proc is not None]
    left = procs.kill_groups([p.proc.pid for p in started], term_timeout=term_timeout)
    for part in started:
        if part._finalizer is not None:
            part._finalizer.detach()
    if left:
        raise ServerError(f"process groups {left} survived SIGKILL")
