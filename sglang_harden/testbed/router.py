"""sglang-router in PD mode as a testbed process (``Router``), in front of one prefill and one decode server or
of a fleet."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sglang_harden.testbed import procs
from sglang_harden.testbed.client import http_json, router_generate
from sglang_harden.testbed.envs import get_recipe, require_env
from sglang_harden.testbed.procenv import testbed_env
from sglang_harden.testbed.server import Server, _Process


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
