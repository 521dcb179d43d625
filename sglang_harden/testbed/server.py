"""Real SGLang servers on CPU: one server, a prefill+decode pair, and sglang-router in front of a pair.

All bind 127.0.0.1 with free ports picked here (HTTP, NCCL, bootstrap). Readiness = SGLang's log line
"fired up and ready to roll" plus a 200 from ``/model_info`` (not ``/health``: it runs a real generate that
takes KV slots and shifts the layout). Each process runs in its own process group, killed exactly on stop,
on a failed start, on garbage collection and at interpreter exit (see ``procs``).
"""

from __future__ import annotations

import re
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from sglang_harden.testbed import procs
from sglang_harden.testbed.client import PairResult, generate, http_json, pd_generate, router_generate
from sglang_harden.testbed.envs import PinRecipe, get_recipe, require_env
from sglang_harden.testbed.model import build_tiny_model
from sglang_harden.testbed.procenv import testbed_env
from sglang_harden.testbed.profiles import Profile, default_profile

Role = Literal["prefill", "decode", "mixed"]
READY_LINE = "fired up and ready to roll"
VANILLA_LAUNCHER = "sglang.launch_server"
HARDENED_LAUNCHER = "sglang_harden.launch_server"
ACTIVATE_ENV = "SGLANG_HARDEN_ACTIVATE"
SECRET_FILE_ENV = "SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"
# the start-up line each armed scheduler logs from its own process (sglang_harden.compat.runtime)
ARMED_LINE = re.compile(r"sglang-harden active: pin=(\S+) family=\S+ role=scheduler/(\S+) pid=(\d+) via=(\S+) "
                        r"guards=(\S*)")


@dataclass(frozen=True)
class ArmedScheduler:
    pin: str
    role: str
    pid: int
    via: str
    guards: tuple[str, ...]


class ServerError(RuntimeError):
    """A server did not come up (the message carries the tail of its log)."""


class PortTaken(ServerError):
    """A server could not bind one of the ports picked for it (someone took it while it booted)."""


BIND_FAILURE = "address already in use"


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _progress(msg: str) -> None:
    print(f"[testbed] {msg}", file=sys.stderr, flush=True)


class _Process:
    """Shared start/stop/log plumbing for a server or router process group."""

    name: str
    log_path: Path

    def __init__(self) -> None:
        self.proc: Any = None
        self._finalizer: weakref.finalize | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _spawn(self, cmd: Sequence[str], env: Mapping[str, str]) -> None:
        if self.proc is not None:
            raise ServerError(f"{self.name} already started")
        self.log_path.write_text(f"# {' '.join(cmd)}\n")
        self.proc = procs.spawn(cmd, env, self.log_path)
        self._finalizer = weakref.finalize(self, procs.kill_groups, [self.proc.pid], 3.0, 5.0)

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def detach(self) -> None:
        """Leave the process running after this object and this interpreter are gone."""
        if self._finalizer is not None:
            self._finalizer.detach()
        if self.proc is not None:
            procs.detach(self.proc.pid)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def stop(self, term_timeout: float = 10.0) -> None:
        """SIGTERM this process group, SIGKILL it after ``term_timeout``; raises if it survives."""
        if self.proc is None:
            return
        left = procs.kill_groups([self.proc.pid], term_timeout=term_timeout)
        if self._finalizer is not None:
            self._finalizer.detach()
        if left:
            raise ServerError(f"{self.name}: process group {self.proc.pid} survived SIGKILL")

    @property
    def secret_file(self) -> Path:
        """This server's own copy of the testbed's control-plane secret (a copy per server, so a test can rotate
        one node at a time); made on first use. A vanilla server never reads it."""
        path = self.log_dir / f"{self.name}.secret"
        if not path.exists():
            path.write_text(testbed_secret() + "\n")
            path.chmod(0o600)
        return path

    def pick_ports(self) -> None:
        raise NotImplementedError

    def own_ports(self) -> list[int]:
        return []

    def _lost_a_port(self, log: str) -> bool:
        """A log line says one of the ports picked for this process could not be bound (others' retries of
        their own ports, e.g. a transport probing for a free one, do not count)."""
        ports = self.own_ports()
        if not ports:
            return False
        own_port = re.compile(r"\b(" + "|".join(map(str, ports)) + r")\b")
        return any(BIND_FAILURE in line.lower() and own_port.search(line) for line in log.splitlines())

    def reset(self) -> None:
        """Forget a stopped process so that the server can be started again on fresh ports."""
        if self.is_alive():
            raise ServerError(f"{self.name} is still running")
        self.proc, self._finalizer = None, None
        self.pick_ports()

    def _fail(self, why: str) -> ServerError:
        return ServerError(f"{self.name}: {why}\n--- {self.log_path} (tail) ---\n{self.log_tail()}")


class Server(_Process):
    """One SGLang server process group (``python -m <launcher>``) for a pin."""

    def __init__(
        self,
        pin: str,
        role: Role = "mixed",
        *,
        max_total_tokens: int,
        context_length: int = 512,
        model_path: Path | None = None,
        transfer_backend: str = "mooncake",
        bootstrap_port: int | None = None,
        num_reserved_decode_tokens: int | None = 32,
        profile: Profile | None = None,
        extra_flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        launcher_module: str = VANILLA_LAUNCHER,
        log_dir: Path | None = None,
        startup_timeout: float = 600.0,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.pin, self.role = pin, role
        self.recipe: PinRecipe = get_recipe(pin)
        self.python = require_env(pin)
        self.model_path = model_path or build_tiny_model(pin)
        self.max_total_tokens, self.context_length = max_total_tokens, context_length
        self.transfer_backend = transfer_backend
        self.num_reserved_decode_tokens = num_reserved_decode_tokens
        self.profile = profile or default_profile()
        self.extra_flags, self.extra_env = list(extra_flags), dict(env or {})
        self.launcher_module, self.startup_timeout = launcher_module, startup_timeout
        self.name = name or f"{role}-{pin}"
        self._fixed_bootstrap_port = bootstrap_port
        self.pick_ports()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sglang-harden-testbed-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}.log"
        self.ready_s: float | None = None
        if transfer_backend not in self.recipe.transfer_backends and role != "mixed":
            raise ServerError(
                f"transfer backend {transfer_backend!r} is not tested on {pin} "
                f"(pins.toml lists {list(self.recipe.transfer_backends)})"
            )

    def pick_ports(self) -> None:
        """Pick fresh loopback ports (only before a start, or after a stop)."""
        self.port = procs.free_port(span=3)
        self.nccl_port = procs.free_port()
        fixed = self._fixed_bootstrap_port
        self.bootstrap_port = fixed or (procs.free_port() if self.role == "prefill" else None)

    def own_ports(self) -> list[int]:
        return [p for p in (self.port, self.nccl_port, self.bootstrap_port) if p]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            str(self.python),
            "-m",
            self.launcher_module,
            "--model-path",
            str(self.model_path),
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-cuda-graph",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--nccl-port",
            str(self.nccl_port),
            "--max-total-tokens",
            str(self.max_total_tokens),
            "--context-length",
            str(self.context_length),
            "--random-seed",
            "0",
        ]
        cmd += self.profile.server_flags()
        if self.role != "mixed":
            cmd += ["--disaggregation-mode", self.role, "--disaggregation-transfer-backend", self.transfer_backend]
        if self.role == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port), *self.recipe.prefill_flags]
        if self.role == "decode":
            if self.num_reserved_decode_tokens is not None:
                cmd += ["--num-reserved-decode-tokens", str(self.num_reserved_decode_tokens)]
            cmd += list(self.recipe.decode_flags)
        return cmd + self.extra_flags

    def environment(self) -> dict[str, str]:
        """The pin's CPU env + shims + extra env. sglang-harden is installed in every pin venv and SGLang's
        plugin loader would arm it: a vanilla launch gets ``SGLANG_HARDEN_ACTIVATE=0`` unless given."""
        extra = {**self.profile.server_env(), **self.extra_env}
        if self.launcher_module == VANILLA_LAUNCHER:
            extra.setdefault(ACTIVATE_ENV, "0")
        if SECRET_FILE_ENV not in extra and self.recipe.control_plane_auth:
            extra[SECRET_FILE_ENV] = str(self.secret_file)
        env = testbed_env(self.recipe, extra)
        for name in self.profile.dropped_env():
            if name not in self.extra_env:
                env.pop(name, None)
        return env

    def start(self) -> Server:
        """Launch without waiting (see ``wait_ready``)."""
        self._started_at = time.monotonic()
        self._spawn(self.command(), self.environment())
        return self

    def wait_ready(self, timeout: float | None = None) -> Server:
        """Block until the ready line and ``/model_info`` answer; on timeout or death stop it and raise."""
        deadline = self._started_at + (timeout or self.startup_timeout)
        try:
            self._wait_log_line(deadline)
            self._wait_model_info(deadline)
        except BaseException:
            self.stop(term_timeout=3.0)
            raise
        self.ready_s = time.monotonic() - self._started_at
        return self

    def _wait_log_line(self, deadline: float) -> None:
        while READY_LINE not in (text := self.log_text()):
            if self._lost_a_port(text):
                raise PortTaken(str(self._fail("a port picked for it was taken while it booted")))
            if not self.is_alive():
                raise self._fail(f"exited with code {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise self._fail("timed out waiting for the ready line")
            time.sleep(0.25)

    def _wait_model_info(self, deadline: float) -> None:
        while True:
            for path in ("/model_info", "/get_model_info"):
                try:
                    status, _ = http_json("GET", self.url + path, timeout=5.0)
                except OSError:
                    status = -1
                if status == 200:
                    return
            if not self.is_alive():
                raise self._fail("exited while waiting for /model_info")
            if time.monotonic() > deadline:
                raise self._fail("timed out waiting for /model_info")
            time.sleep(0.25)

    def server_info(self, timeout: float = 60.0) -> dict[str, Any]:
        """The server's info document. The scheduler answers it between batches, so on a loaded host one
        attempt can time out; it is asked again until ``timeout`` passes or the server exits."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._server_info_once()
            except OSError as exc:
                if not self.is_alive():
                    raise self._fail(f"exited while answering server info ({exc})") from exc
                if time.monotonic() > deadline:
                    raise self._fail(f"server info did not answer within {timeout:.0f} s ({exc})") from exc
            time.sleep(0.5)

    def _server_info_once(self) -> dict[str, Any]:
        for path in ("/server_info", "/get_server_info"):
            status, body = http_json("GET", self.url + path, timeout=15.0)
            if status == 200 and isinstance(body, dict):
                return body
        raise self._fail("no server info endpoint answered")

    def harden_state(self) -> dict[str, Any]:
        """The first scheduler's own sglang-harden report on ``/server_info`` (pin, guards, decisions, ...;
        empty on vanilla)."""
        states = self.server_info().get("internal_states") or [{}]
        return dict((states[0] or {}).get("sglang_harden") or {})

    def harden_decisions(self) -> dict[str, int]:
        """The first scheduler's sglang-harden decision counts, ``{"guard:decision": n}`` (empty on vanilla)."""
        return dict(self.harden_state().get("decisions", {}))

    def armed_schedulers(self) -> list[ArmedScheduler]:
        """Every scheduler start-up line of sglang-harden in this server's log (one per scheduler process)."""
        return [ArmedScheduler(m[0], m[1], int(m[2]), m[3], tuple(filter(None, m[4].split(","))))
                for m in ARMED_LINE.findall(self.log_text())]

    def pool(self) -> dict[str, Any]:
        """KV allocator occupancy of the first scheduler (testbed pool reporter): total, available, evictable,
        full; on a hardened server also ``harden_lifecycle`` (its page-ledger report)."""
        states = self.server_info().get("internal_states") or [{}]
        numbers = dict(states[0].get("testbed_pool") or {})
        if "total" in numbers:
            numbers["full"] = numbers["available"] + numbers["evictable"] >= numbers["total"]
        harden = states[0].get("sglang_harden")
        if isinstance(harden, dict):  # hardened server: its page-lifecycle report rides along
            numbers["harden_lifecycle"] = harden.get("lifecycle")
        return numbers

    def wait_pool_full(self, timeout: float) -> dict[str, Any]:
        """Poll :meth:`pool` until the allocator is back to full capacity or ``timeout`` passes; adds waited_s."""
        t0 = time.monotonic()
        while True:
            numbers = self.pool()
            if numbers.get("full") or time.monotonic() - t0 > timeout:
                return {**numbers, "waited_s": round(time.monotonic() - t0, 2)}
            time.sleep(0.25)

    def generate(self, body: dict[str, Any], timeout: float = 120.0) -> Any:
        return generate(self.url, body, timeout)

    def __enter__(self) -> Server:
        try:
            return self.start().wait_ready()
        except BaseException:
            self.stop(term_timeout=3.0)
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Router(_Process):
    """sglang-router in PD mode in front of prefill and decode servers (one of each, or several: a fleet)."""

    def __init__(
        self,
        pin: str,
        prefill: Server | Sequence[Server],
        decode: Server | Sequence[Server],
        log_dir: Path,
        startup_timeout: float = 120.0,
        extra_flags: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.recipe = get_recipe(pin)
        self.python = require_env(pin)
        self.prefills = [prefill] if isinstance(prefill, Server) else list(prefill)
        self.decodes = [decode] if isinstance(decode, Server) else list(decode)
        self.pick_ports()
        self.name, self.log_path = f"router-{pin}", Path(log_dir) / f"router-{pin}.log"
        self.startup_timeout, self.extra_flags = startup_timeout, list(extra_flags)
        self.ready_s: float | None = None

    def pick_ports(self) -> None:
        self.port, self.prometheus_port = procs.free_port(), procs.free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            *[arg for p in self.prefills for arg in ("--prefill", p.url, str(p.bootstrap_port))],
            *[arg for d in self.decodes for arg in ("--decode", d.url)],
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--policy",
            "round_robin",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.prometheus_port),
            "--health-check-endpoint",
            "/get_model_info",
            "--health-check-interval-secs",
            "3600",
            *self.extra_flags,
        ]

    def start(self) -> Router:
        self._started_at = time.monotonic()
        self._spawn(self.command(), testbed_env(self.recipe))
        return self

    def wait_ready(self) -> Router:
        deadline = self._started_at + self.startup_timeout
        try:
            while not self._answers():
                if not self.is_alive():
                    raise self._fail(f"exited with code {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise self._fail("timed out waiting for the router")
                time.sleep(0.5)
        except BaseException:
            self.stop(term_timeout=3.0)
            raise
        self.ready_s = time.monotonic() - self._started_at
        return self

    def _answers(self) -> bool:
        try:
            status, _ = http_json("GET", self.url + "/v1/models", timeout=5.0)
        except OSError:
            return False
        return status == 200

    def generate(self, body: dict[str, Any], timeout: float = 120.0) -> Any:
        return router_generate(self.url, body, timeout)


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
    ) -> None:
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
        _stop_all([p for p in (self.router, self.prefill, self.decode) if p is not None], term_timeout)

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
        _stop_all(self.parts(), term_timeout)

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


def _stop_all(parts: Sequence[_Process], term_timeout: float) -> None:
    """Signal the process groups of every started part together; raise if one survives SIGKILL."""
    started = [p for p in parts if p.proc is not None]
    left = procs.kill_groups([p.proc.pid for p in started], term_timeout=term_timeout)
    for part in started:
        if part._finalizer is not None:
            part._finalizer.detach()
    if left:
        raise ServerError(f"process groups {left} survived SIGKILL")


def testbed_secret() -> str:
    """The testbed's control-plane secret (random, made once per machine, mode 600): every hardened testbed
    server authenticates its PD control plane with it unless a test sets ``SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE``
    itself ("" for none)."""
    import secrets

    from sglang_harden.testbed.envs import harden_home

    path = harden_home() / "testbed-bootstrap-secret"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32) + "\n")
        path.chmod(0o600)
    return path.read_text().strip()
