"""One real SGLang server on CPU (``Server``) and the process-group plumbing it shares with sglang-router
(``_Process``); the router is in ``router``, a prefill+decode pair and a fleet in ``pd_topology``.

All bind 127.0.0.1 with free ports picked here (HTTP, NCCL, bootstrap). Readiness = SGLang's log line
"fired up and ready to roll" plus a 200 from ``/model_info`` (not ``/health``: it runs a real generate that
takes KV slots and shifts the layout). Each process runs in its own process group, killed exactly on stop,
on a failed start, on garbage collection and at interpreter exit (see ``procs``).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sglang_harden.testbed import procs
from sglang_harden.testbed.client import generate, http_json
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

    def reset(self, exit_wait_s: float = 10.0) -> None:
        """Forget a stopped process so that the server can be started again on fresh ports. Its group was found gone
        when it stopped, but the leader itself may still be exiting (its last threads): wait for it up to
        ``exit_wait_s`` rather than take it for a running server."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=exit_wait_s)
            except subprocess.TimeoutExpired:
                raise ServerError(f"{self.name} is still running") from None
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
        python: Path | None = None,
    ) -> None:
        super().__init__()
        self.pin, self.role = pin, role
        self.recipe: PinRecipe = get_recipe(pin)
        self.python = python or require_env(pin)
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
        if isinstance(harden, dict) and not harden.get("series"):  # the plugin's report (a series names only itself)
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
