"""Testbed: real SGLang prefill/decode pairs on CPU for each supported pin (see DESIGN.md).

Public API (stdlib only on the caller's side; SGLang runs in the pin's own venv):

- envs: ``ensure_env(pin)``, ``require_env(pin)``, ``load_pins()``, ``ci_pins()``, ``all_pins()``
- model: ``build_tiny_model(pin)``
- servers: ``Server``, ``PDPair``, ``Router`` (context managers; kill exactly their own process groups)
- requests: ``greedy_body``, ``generate``, ``pd_generate``, ``router_generate``
- scenario: ``run_incident(pin, hardened)``, ``IncidentSetup``
"""

from sglang_harden.testbed.client import GenResult, PairResult, generate, greedy_body, pd_generate, router_generate
from sglang_harden.testbed.envs import EnvError, all_pins, ci_pins, ensure_env, load_pins, require_env
from sglang_harden.testbed.incident import IncidentSetup, run_incident
from sglang_harden.testbed.model import build_tiny_model
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.router import Router
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER, Server, ServerError

__all__ = [
    "EnvError",
    "GenResult",
    "HARDENED_LAUNCHER",
    "IncidentSetup",
    "PDPair",
    "PairResult",
    "Router",
    "Server",
    "ServerError",
    "VANILLA_LAUNCHER",
    "all_pins",
    "build_tiny_model",
    "ci_pins",
    "ensure_env",
    "generate",
    "greedy_body",
    "load_pins",
    "pd_generate",
    "require_env",
    "router_generate",
    "run_incident",
]
