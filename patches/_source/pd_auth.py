"""Authentication of the PD control plane (sglang-harden backport, not upstream SGLang code).

Whoever reaches prefill's bootstrap port can otherwise register as decode for a room (``PUT /route``), post or
read rejection notices (``/pd_rejections``) and query ranks. With a shared secret configured, every request to
every route of the bootstrap server except ``/health`` must carry a token, every bootstrap client in this process
(SGLang's, through ``common/conn.py``'s ``requests``, and ``pd_rejections``) signs what it sends, and a client
uses an answer (below 400) only when the server signed it for that request:

    X-SGLang-Harden-Auth: sgh2.<ts>.<nonce>.<hex sha256(body)>.<mac>
    mac = hex HMAC-SHA256(secret, "sgh2\\n<METHOD>\\n<host:port>\\n<path?query as sent>\\n<hex sha256(body)>\\n<ts>\\n<nonce>")
    X-SGLang-Harden-Answer: sgh2.<hex HMAC-SHA256(secret, "sgh2-answer\\n<request mac>\\n<status>\\n<hex sha256(answer body)>")>

``host:port`` is the authority the client addressed, canonical (lowercase, the port always written); the server
recomputes it from the Host header it received and serves only a Host that names it (its bind host, host name, FQDN
or the address the connection arrived on, with its port; or a name listed in SGLANG_HARDEN_BOOTSTRAP_AUTHORITIES),
so a token cannot be replayed to another bootstrap server. The server checks the token before it reads the body
(the body must then hash to what the token says), compares MACs in constant time, refuses tokens older than the
validity window and nonces it has seen; anything else gets 401 (the log line never holds the token). The rules are
the sglang-harden plugin's own code, bundled below when the series is generated, so patched and plugin nodes of one
deployment interoperate.

Env (of every SGLang process of the deployment, prefill and decode):
  SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE       the signing secret on the first line, optionally one more accepted
                                            secret on the second (rotation: add the new one second everywhere, swap
                                            the lines everywhere, drop the old one); each at least 32 characters,
                                            UTF-8; the file is re-read when it changes
  SGLANG_HARDEN_BOOTSTRAP_AUTH              enforce (default with a secret file) | log (refusals logged, served and
                                            answers used) | off
  SGLANG_HARDEN_BOOTSTRAP_AUTH_MAX_AGE_S    token validity in seconds (default 60)
  SGLANG_HARDEN_BOOTSTRAP_AUTHORITIES       other names of this bootstrap server (host:port, *:port or *, comma-
                                            separated): DNS aliases, a Service in front of it
  SGLANG_HARDEN_BOOTSTRAP_AUTH_ACCEPT_SGH1  1: also accept sgh1 tokens (no Host binding) while a fleet rolls out
  SGLANG_HARDEN_MODE                        log | enforce: the default of every switch of the series (with a
                                            secret file, of this one too); a switch's own variable overrides it
Any other SGLANG_HARDEN_* name that no sglang-harden reads (a typo) refuses to start, naming the nearest one.
No secret file: nothing is signed or checked and a WARNING says the control plane is unauthenticated.
``enforce`` asked for without a secret file, or an unusable setting or secret file: importing this module raises
``ConfigurationError`` (the server refuses to start).
"""

from __future__ import annotations

import logging
import os
import urllib.request
from enum import Enum
from typing import Any, Dict, Optional
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

ENV_SECRET_FILE = "SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"
ENV_MODE = "SGLANG_HARDEN_BOOTSTRAP_AUTH"
ENV_MAX_AGE = "SGLANG_HARDEN_BOOTSTRAP_AUTH_MAX_AGE_S"
ENV_AUTHORITIES = "SGLANG_HARDEN_BOOTSTRAP_AUTHORITIES"
ENV_ACCEPT_SGH1 = "SGLANG_HARDEN_BOOTSTRAP_AUTH_ACCEPT_SGH1"
# Every SGLANG_HARDEN_* variable the series reads (docs/deploy.md lists the same; a test compares them).
SERIES_SETTINGS = frozenset({
    "SGLANG_HARDEN_MODE", ENV_SECRET_FILE, ENV_MODE, ENV_MAX_AGE, ENV_AUTHORITIES, ENV_ACCEPT_SGH1,
    "SGLANG_HARDEN_ZMQ_AUTH", "SGLANG_HARDEN_ZMQ_SIGN", "SGLANG_HARDEN_SIDE_CHANNELS", "SGLANG_HARDEN_CAPACITY",
    "SGLANG_HARDEN_LIFECYCLE", "SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S", "SGLANG_HARDEN_QUARANTINE_CAP_PAGES",
    "SGLANG_HARDEN_CHECKSUM", "SGLANG_HARDEN_CHECKSUM_WAIT_MS", "SGLANG_HARDEN_CANARY", "SGLANG_HARDEN_PAGE_TAGS",
})
SETTING_PREFIX, TESTBED_PREFIX = "SGLANG_HARDEN_", "SGLANG_HARDEN_TESTBED_"
# <series stamp>


class ConfigurationError(RuntimeError):
    """The authentication settings cannot be used (the message never contains a secret)."""


# <prelude>


# <bundle sglang_harden/guards/base.py sglang_harden/guards/bootstrap_auth.py sglang_harden/compat/control_keys.py sglang_harden/compat/bootstrap_http.py sglang_harden/compat/signing_client.py>


# ---- the backport's own glue: the environment in, SGLang's server and clients protected


class Authenticator(ControlKeys):
    """This process's control-plane keys (``ControlKeys``) and its mode."""

    def __init__(self, path: str, mode: str, max_age_s: float, accept_sgh1: bool, listed: frozenset) -> None:
        try:
            secrets_file = SecretFile(path)
        except SecretFileError as exc:
            raise ConfigurationError(str(exc)) from None
        super().__init__(secrets_file, self._report, max_age_s=max_age_s, accept_sgh1=accept_sgh1, listed=listed)
        self.path, self.mode = path, mode

    def _report(self, decision: Decision, about: Any) -> bool:
        """Log a refusal (never the token); True when it is applied (enforce)."""
        if decision.allows:
            return False
        what = (f"{about.get('method')} {about.get('path')} from {about.get('remote')}" if "path" in about
                else f"the answer from {about.get('url')}")
        names = decision.fields.get("names")
        logger.warning("pd_auth: %s %s: %s%s", "refused" if self.mode == "enforce" else "would refuse", what,
                       decision.reason, f" (this server answers to {names})" if names else "")
        return self.mode == "enforce"

    def accepted(self) -> tuple:
        return self.refreshed().accepted

    def refusal(self, method: str, authority: Optional[str], target: str, body: bytes, token: Optional[str],
                identity: Optional[ServerIdentity] = None) -> Optional[str]:
        """None when a request to this process's server may be served, else why not (tests and tools)."""
        identity = identity or ServerIdentity(None, listed=frozenset({"*"}))
        decision = verify(self.refreshed(), RequestHead(method, authority, target), body, token, self.nonces,
                          identity=identity, max_age_s=self.max_age_s, accept_sgh1=self.accept_sgh1)
        return None if decision.allows else decision.reason


def _flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value not in ("", "0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ConfigurationError(f"{name}={value!r}: expected 1 or 0")
    return value in ("1", "true", "yes", "on")


def check_settings(environ: Any) -> None:
    """Refuse to start on an SGLANG_HARDEN_* variable no sglang-harden reads (a typo), naming the nearest known
    name; say once which plugin settings are set that the series does not read (they change nothing here)."""
    import difflib

    unknown, plugin_only = [], []
    suffixes = sorted({name[len(SETTING_PREFIX):] for name in SERIES_SETTINGS} | PLUGIN_SETTING_SUFFIXES)
    for name in sorted(environ):
        if not name.startswith(SETTING_PREFIX) or name in SERIES_SETTINGS or name.startswith(TESTBED_PREFIX):
            continue
        if name[len(SETTING_PREFIX):] in PLUGIN_SETTING_SUFFIXES:
            plugin_only.append(name)
            continue
        nearest = difflib.get_close_matches(name[len(SETTING_PREFIX):], suffixes, n=1, cutoff=0.6)
        unknown.append(name + (f" (did you mean {SETTING_PREFIX}{nearest[0]}?)" if nearest else ""))
    if unknown:
        raise ConfigurationError("unknown setting " + ", ".join(unknown) + ": the backport series reads "
                                 + ", ".join(sorted(SERIES_SETTINGS)))
    if plugin_only:
        logger.info("pd_auth: set but not read by the backport series (plugin settings): %s", ", ".join(plugin_only))


def _load() -> Optional[Authenticator]:
    path = os.environ.get(ENV_SECRET_FILE, "").strip()
    # SGLANG_HARDEN_MODE applies where a secret makes authentication possible (as in the plugin)
    mode = os.environ.get(ENV_MODE, "").strip().lower() or (series_rollout_mode() if path else "")
    if mode and mode not in MODES:
        raise ConfigurationError(f"{ENV_MODE}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        logger.warning("pd_auth: %s=off: the PD control plane is UNAUTHENTICATED", ENV_MODE)
        return None
    if not path:
        if mode == "enforce":
            raise ConfigurationError(f"{ENV_MODE}=enforce needs a secret: set {ENV_SECRET_FILE} to a file")
        logger.warning("pd_auth: the PD control plane is UNAUTHENTICATED (no %s): anyone who reaches the "
                       "bootstrap port can register routes and post or read rejection notices", ENV_SECRET_FILE)
        return None
    try:
        max_age_s = float(os.environ.get(ENV_MAX_AGE, "60"))
    except ValueError:
        raise ConfigurationError(f"{ENV_MAX_AGE} must be a number of seconds") from None
    if not max_age_s > 0:
        raise ConfigurationError(f"{ENV_MAX_AGE} must be > 0")
    try:
        listed = parse_listed(os.environ.get(ENV_AUTHORITIES, ""))
    except ValueError as exc:
        raise ConfigurationError(f"{ENV_AUTHORITIES}: {exc}") from None
    if not os.path.isfile(path):
        raise ConfigurationError(f"the bootstrap secret file {path} does not exist")
    authenticator = Authenticator(path, mode or "enforce", max_age_s, _flag(ENV_ACCEPT_SGH1), listed)
    logger.info("pd_auth: PD control plane authenticated (%s mode, %d secret(s))", authenticator.mode,
                len(authenticator.accepted()))
    return authenticator


# the switches that take a mode; the patches without one (admission, retirement, coverage, notices) always enforce
MODE_SWITCHES = ("SGLANG_HARDEN_CANARY", "SGLANG_HARDEN_PAGE_TAGS", "SGLANG_HARDEN_CHECKSUM", "SGLANG_HARDEN_LIFECYCLE",
                 "SGLANG_HARDEN_SIDE_CHANNELS")


def zmq_auth_mode(authenticator: Optional[Authenticator]) -> str:
    """The side channels' authentication as pd_side_channels decides it: ``unauthenticated`` without a secret."""
    if authenticator is None:
        return "unauthenticated"
    return os.environ.get("SGLANG_HARDEN_ZMQ_AUTH", "").strip().lower() or series_rollout_mode() or "enforce"


def build_info_labels(authenticator: Optional[Authenticator]) -> Dict[str, str]:
    """The plugin's ``sglang_harden_build_info`` labels for this process of a patched tree: the series' release,
    SGLang's, family ``patched``, role ``scheduler`` (which side is not known here) and the rollout mode as the
    plugin sums it up (``enforce``/``log`` when every guard is in it, else ``mixed``)."""
    import importlib.metadata

    modes = {"enforce"} | {mode_from_env(name) for name in MODE_SWITCHES}
    if authenticator is not None:  # both authentication switches count only with a secret, as in the plugin
        modes.add(authenticator.mode)
        modes.add(zmq_auth_mode(authenticator))
    modes.discard("off")
    try:
        pin = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pin = "unknown"
    return {"version": SERIES_VERSION, "pin": pin, "family": "patched", "role": "scheduler",
            "mode": modes.pop() if len(modes) == 1 else "mixed"}


def publish_build_info(labels: Dict[str, str]) -> None:
    """``sglang_harden_build_info{...} 1`` on ``/metrics`` as the plugin exports it, from the processes SGLang started
    for metrics (its schedulers: ``PROMETHEUS_MULTIPROC_DIR`` set). Elsewhere nothing: prometheus_client picks
    where its samples go when it is first imported, and SGLang's main process imports this module before it sets
    that variable (an import here would keep the main process's own metrics off ``/metrics``). Metrics never stop
    a start."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    try:
        import prometheus_client

        gauge = prometheus_client.Gauge("sglang_harden_build_info",
                                        "sglang-harden version, SGLang pin and rollout mode of this process",
                                        labelnames=tuple(labels), multiprocess_mode="max")
        gauge.labels(**labels).set(1)
    except Exception as exc:  # noqa: BLE001 - evidence only
        logger.info("pd_auth: no sglang_harden_build_info on /metrics here: %s", exc)


def server_info_block() -> Dict[str, Any]:
    """The scheduler's ``sglang_harden`` block on ``/server_info`` (the plugin's keys a patched tree has)."""
    return {**build_info_labels(AUTH), "series": True,
            "control_plane_auth": "unauthenticated" if AUTH is None else AUTH.mode,
            "side_channel_auth": zmq_auth_mode(AUTH)}


check_settings(os.environ)
logger.info("pd_auth: backport series %s of sglang-harden", SERIES_VERSION)
AUTH = _load()
SIGNER = CurrentSigner(lambda: AUTH)
publish_build_info(build_info_labels(AUTH))


def headers(method: str, authority: str, target: str, body: Any) -> Dict[str, str]:
    """The token header of one request to the bootstrap server at ``authority`` ({} when not configured)."""
    return SIGNER.headers(method, authority, target, body)


class UntrustedAnswer(OSError):
    """A bootstrap server's answer that was not signed for the request (raised where the caller expects OSError)."""


def trusted_body(request: urllib.request.Request, response: Any, limit: int) -> bytes:
    """The body of ``response`` (at most ``limit`` bytes) to the signed urllib ``request``; UntrustedAnswer when
    the server did not sign it for that request."""
    body = response.read(limit)
    token = request.get_header(HEADER.capitalize())  # urllib capitalizes the names it stores
    sent = {HEADER: token} if token else {}
    split = urlsplit(request.full_url)
    refusal = SIGNER.answer_refusal(sent, response.status, response.headers, body, url=f"{split.netloc}{split.path}")
    if refusal is not None:
        raise UntrustedAnswer(refusal)
    return body


# ------------------------------------------------------------------ server side


def protect(app: Any, host: Optional[str], port: Optional[int]) -> None:
    """Every request to the bootstrap server's ``app`` on ``host:port`` (except ``/health``) passes the token
    check, and its answers are signed."""
    from aiohttp import web

    if AUTH is None:
        return
    identity = server_identity(host, port, AUTH.listed)

    async def check_token(request: Any, handler: Any) -> Any:
        return await checked_request(AUTH, identity, request, handler, label="pd_auth")

    app.middlewares.append(web.middleware(check_token))


# ------------------------------------------------------------------ client side


def signing(requests_module: Any) -> Any:
    """``requests`` itself when the control plane is unauthenticated, else a signing, answer-checking proxy."""
    return SigningRequests(requests_module, SIGNER) if AUTH is not None else requests_module


if __name__ == "__main__":  # python3 -m sglang.srt.disaggregation.common.pd_auth --version
    import sys

    if sys.argv[1:] != ["--version"]:
        sys.exit("usage: python3 -m sglang.srt.disaggregation.common.pd_auth --version")
    print(f"sglang-harden backport series {SERIES_VERSION}")
