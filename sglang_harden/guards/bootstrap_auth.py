"""Control-plane authentication: only holders of the PD deployment's shared secret may use its control routes,
a request signed for one bootstrap server is refused by every other, and a client trusts only signed answers.

Invariant: a request to a protected route (every route of the bootstrap server but ``/health``) is served only
when its token ``sgh2.<ts>.<nonce>.<body sha256>.<mac>`` is ASCII and well-formed, ``ts`` is within ``max_age_s``
of the verifier's clock, the request's one ``Host`` header names this server, ``mac`` is HMAC-SHA256 under an
accepted secret of the method, that Host, the target (path and query as sent), the body hash, ``ts`` and
``nonce`` (compared in constant time), no token with that ``ts`` and nonce was served before, and the body hashes
to what the token says. Anything else gets 401. A client takes an answer below 400 to its signed request only
with a MAC over that request's MAC, the status and the body.

Order. Everything but the body hash is checked before the body is read, so a client without the secret never
makes the server buffer a body. The nonce is spent before the body arrives: a captured token cannot open many
bodies at once.

Host binding (issue 39). The MAC covers the authority the client addressed (``host:port``, canonical: lowercase,
IP literals normalised, the port always written, 80 when absent); the verifier recomputes it from the Host header
it received, so a token cannot be moved to another Host. The Host must also name this server: an authority the
operator listed (``SGLANG_HARDEN_BOOTSTRAP_AUTHORITIES``), or, on the port the server was started on, its bind
host, this machine's host name or FQDN, the address the connection arrived on, or (a loopback connection only)
``localhost`` and the wildcard addresses. Residual risk: where one name reaches several bootstrap servers (a load
balancer, a NAT or a Kubernetes Service in front of them, a name listed on several, a ``*`` entry), a token signed
for that name can be replayed, within its validity, to each of them once (each keeps its own replay cache). A name
the server cannot know (a DNS alias, a Service) is refused until listed.

Answers. The server signs each answer to an admitted request; a client holding the secret refuses an answer below
400 without a valid signature for its request (prefill's ``/route`` answer tells decode which rank ports to
connect to). Residual risk: an error answer (400 and up) is not signed, so whoever sits on the path can make a
request fail, as dropping it would.

Versions. ``sgh1`` tokens (sglang-harden before issue 39) bind no Host and are refused unless the verifier
accepts them for a rollout (``accept_sgh1``; then their MAC and nonce are checked after the body, as before).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heappop, heappush

from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "bootstrap_auth"
HEADER = "X-SGLang-Harden-Auth"
ANSWER_HEADER = "X-SGLang-Harden-Answer"
VERSION = "sgh2"
LEGACY_VERSION = "sgh1"
OPEN_PATHS = frozenset({"/health"})
MIN_SECRET_CHARS = 32
MAX_SECRETS = 2
DEFAULT_MAX_AGE_S = 60.0
DEFAULT_MAX_NONCES = 200_000
DEFAULT_PORT = 80
NONCE_CHARS = 32
MAX_TOKEN_CHARS = 256
MAX_AUTHORITY_CHARS = 300
MAX_TIMESTAMP_DIGITS = 12
_HEX = frozenset("0123456789abcdef")
_DIGITS = frozenset("0123456789")
_NOT_IN_HOST = frozenset(" \t\r\n/\\@?#,;\"'<>")
# Names of this machine only a local client uses (SGLang 0.5.10 registers prefill at its wildcard bind address).
LOOPBACK_NAMES = frozenset({"localhost", "0.0.0.0", "::"})


class SecretFileError(ValueError):
    """The secret file cannot be used (the message never contains a secret)."""


@dataclass(frozen=True)
class Keyring:
    """The secret new tokens are signed with, and every secret a token may be signed with (signing first)."""

    signing: bytes
    accepted: tuple[bytes, ...]

    def __repr__(self) -> str:  # never print a secret
        return f"Keyring(<{len(self.accepted)} secret(s)>)"


def parse_secrets(text: str) -> Keyring:
    """One secret per line (blank lines and ``#`` comments ignored): the signing one, then an optional second."""
    found = [line.strip() for line in text.splitlines()]
    found = [line for line in found if line and not line.startswith("#")]
    if not found:
        raise SecretFileError("the bootstrap secret file holds no secret")
    if len(found) > MAX_SECRETS:
        raise SecretFileError(f"the bootstrap secret file holds {len(found)} secrets; at most {MAX_SECRETS} "
                              "(the signing secret, then one more accepted during a rotation)")
    for number, secret in enumerate(found, start=1):
        if len(secret) < MIN_SECRET_CHARS:
            raise SecretFileError(f"secret {number} in the bootstrap secret file is {len(secret)} characters; "
                                  f"at least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)")
    keys = tuple(secret.encode() for secret in found)
    return Keyring(keys[0], keys)


def parse_secret_bytes(data: bytes) -> Keyring:
    """The secret file's bytes: UTF-8 text as :func:`parse_secrets` reads it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SecretFileError(f"the bootstrap secret file is not UTF-8 text (byte {exc.start})") from None
    return parse_secrets(text)


def body_digest(body: bytes | str | None) -> str:
    data = body.encode() if isinstance(body, str) else (body or b"")
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- who a request is for


def canonical_host(host: str) -> str | None:
    """A host name lowercased, an IP address in its canonical form (an IPv4-mapped IPv6 address as IPv4); None when
    it cannot be a host."""
    if not host or not host.isascii() or not host.isprintable() or _NOT_IN_HOST.intersection(host):
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None if ":" in host or "[" in host or "]" in host else host.lower()
    mapped = getattr(address, "ipv4_mapped", None)
    return str(mapped or address)


def split_authority(text: str | None) -> tuple[str, int] | None:
    """``host[:port]`` or ``[v6]:port`` (a Host header, a URL's netloc) as (canonical host, port); None if invalid."""
    if not text or len(text) > MAX_AUTHORITY_CHARS or not text.isascii():
        return None
    if text.startswith("["):
        host, closed, rest = text[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")) or ":" not in host:
            return None
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text = text.partition(":")
        port_text = port_text if colon else None
        if port_text is not None and ":" in port_text:
            return None  # an IPv6 address without brackets
    port = DEFAULT_PORT
    if port_text is not None:
        if not port_text or len(port_text) > 5 or not _DIGITS.issuperset(port_text) or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    canonical = canonical_host(host)
    return None if canonical is None else (canonical, port)


def join_authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def canonical_authority(text: str | None) -> str | None:
    """The authority both ends put in the MAC: ``host:port`` as :func:`split_authority` reads it."""
    parts = split_authority(text)
    return None if parts is None else join_authority(*parts)


def parse_listed(text: str) -> frozenset[str]:
    """The authorities an operator lists: comma-separated ``host:port`` (the port written), ``*:port`` (any host on
    that port) or ``*`` (any authority: no Host check at all), canonical. ValueError names a bad entry."""
    listed = set()
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if entry == "*" or (entry.startswith("*:") and split_authority("any" + entry[1:]) is not None):
            listed.add(entry)
            continue
        port_part = entry.rpartition("]")[2] if entry.startswith("[") else entry
        canonical = canonical_authority(entry) if ":" in port_part else None
        if canonical is None:
            raise ValueError(f"{entry!r} is not host:port, *:port or *")
        listed.add(canonical)
    return frozenset(listed)


def _is_loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerIdentity:
    """What names one bootstrap server: the port it was started on, its own host names and addresses (canonical),
    and the authorities the operator listed (canonical ``host:port``, ``*:port`` any host on a port, ``*`` any)."""

    port: int | None
    hosts: frozenset[str] = frozenset()
    listed: frozenset[str] = frozenset()

    def names(self, authority: str, local_host: str | None = None) -> bool:
        """Whether ``authority`` (canonical) names this server, for a connection that arrived on ``local_host``."""
        parts = split_authority(authority)
        if parts is None:
            return False
        host, port = parts
        if authority in self.listed or "*" in self.listed or f"*:{port}" in self.listed:
            return True
        local = canonical_host(local_host) if local_host else None
        return port == self.port and (host in self.hosts or host == local
                                      or (host in LOOPBACK_NAMES and _is_loopback(local)))

    def describe(self) -> str:
        names = sorted(self.hosts) + ["<the connection's local address>"]
        mine = ", ".join(join_authority(h, self.port) for h in names) if self.port is not None else ""
        return ", ".join(part for part in (mine, ", ".join(sorted(self.listed))) if part) or "nothing"


# ---------------------------------------------------------------- tokens


@dataclass(frozen=True)
class Token:
    version: str
    timestamp: int
    nonce: str
    body_sha256: str  # sgh2: the body's hash the signer declares; sgh1: "" (its MAC covers the body)
    mac: str


@dataclass(frozen=True)
class RequestHead:
    """What a request says before its body: ``host`` is its Host header (None: missing or repeated), ``target``
    the path and query as sent, ``local_host`` the address the connection arrived on."""

    method: str
    host: str | None
    target: str
    local_host: str | None = None


def _mac(key: bytes, method: str, authority: str, target: str, digest: str, timestamp: int, nonce: str) -> str:
    message = f"{VERSION}\n{method.upper()}\n{authority}\n{target}\n{digest}\n{timestamp}\n{nonce}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _legacy_mac(key: bytes, method: str, target: str, digest: str, timestamp: int, nonce: str) -> str:
    message = f"{LEGACY_VERSION}\n{method.upper()}\n{target}\n{digest}\n{timestamp}\n{nonce}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(keyring: Keyring, method: str, authority: str, target: str, body: bytes | str | None, *,
         now: float | None = None, nonce: str | None = None) -> str:
    """A token for one request to ``authority`` (the ``host:port`` the client addresses) and ``target`` (the
    path with its query string exactly as sent)."""
    where = canonical_authority(authority)
    if where is None:
        raise ValueError(f"not a host:port to sign a request for: {authority!r}")
    timestamp = int(time.time() if now is None else now)
    nonce = nonce or secrets.token_hex(NONCE_CHARS // 2)
    digest = body_digest(body)
    mac = _mac(keyring.signing, method, where, target, digest, timestamp, nonce)
    return f"{VERSION}.{timestamp}.{nonce}.{digest}.{mac}"


def _hex(text: str, length: int) -> bool:
    return len(text) == length and _HEX.issuperset(text)


def read_token(token: str) -> Token | None:
    """The token's fields, checked for shape only (ASCII digits and lowercase hex); None when malformed."""
    if len(token) > MAX_TOKEN_CHARS or not token.isascii():
        return None
    parts = token.split(".")
    if parts[0] == VERSION and len(parts) == 5:
        _, stamp, nonce, digest, mac = parts
    elif parts[0] == LEGACY_VERSION and len(parts) == 4:
        (_, stamp, nonce, mac), digest = parts, ""
    else:
        return None
    if not (0 < len(stamp) <= MAX_TIMESTAMP_DIGITS and _DIGITS.issuperset(stamp)) or not _hex(nonce, NONCE_CHARS) \
            or not _hex(mac, 64) or (parts[0] == VERSION and not _hex(digest, 64)):
        return None
    return Token(parts[0], int(stamp), nonce, digest, mac)


def _refuse(reason: str, status: int = 401, **fields: object) -> Decision:
    return Decision(GUARD, Verdict.REJECT, reason, status, dict(fields))


def _mac_matches(keyring: Keyring, presented: str, compute: Callable[[bytes], str]) -> bool:
    return any(hmac.compare_digest(compute(key).encode(), presented.encode()) for key in keyring.accepted)


def check_head(keyring: Keyring, head: RequestHead, token: str | None, nonces: NonceCache, *,
               identity: ServerIdentity, max_age_s: float = DEFAULT_MAX_AGE_S, accept_sgh1: bool = False,
               now: float | None = None) -> tuple[Decision, Token | None]:
    """Everything that can be decided before the body is read: ALLOW with the token (its nonce now spent, for an
    ``sgh2`` token), or REJECT 401 (the reason never quotes the token)."""
    if not token:
        return _refuse("missing control-plane token"), None
    parsed = read_token(token)
    if parsed is None:
        return _refuse("malformed control-plane token"), None
    if parsed.version == LEGACY_VERSION and not accept_sgh1:
        return _refuse(f"{LEGACY_VERSION} control-plane token (binds no Host; a signer from before issue 39): "
                       f"upgrade it, or accept {LEGACY_VERSION} during the rollout "
                       "(SGLANG_HARDEN_BOOTSTRAP_AUTH_ACCEPT_SGH1=1)"), None
    clock = time.time() if now is None else now
    age = clock - parsed.timestamp
    if abs(age) > max_age_s:
        return _refuse(f"control-plane token is {age:.0f} s old (accepted: within {max_age_s:.0f} s)"), None
    if parsed.version == LEGACY_VERSION:
        return allow(GUARD), parsed  # MAC and nonce once the body is there
    authority = canonical_authority(head.host)
    if authority is None:
        return _refuse("request without one valid Host header"), None
    if not identity.names(authority, head.local_host):
        return _refuse(f"Host {authority} does not name this bootstrap server (a token made for another one?; "
                       "list its other names in SGLANG_HARDEN_BOOTSTRAP_AUTHORITIES)",
                       names=identity.describe()), None
    if not _mac_matches(keyring, parsed.mac, lambda key: _mac(key, head.method, authority, head.target,
                                                             parsed.body_sha256, parsed.timestamp, parsed.nonce)):
        return _refuse("control-plane token does not match (wrong secret, or method, Host, path, query or body "
                       "hash changed)"), None
    return _spend(nonces, parsed, clock), parsed


def _spend(nonces: NonceCache, token: Token, clock: float) -> Decision:
    first = nonces.first_use(token.timestamp, token.nonce, clock)
    if first is None:
        return _refuse(f"control-plane token is older than the replay cache still remembers (it is at its cap of "
                       f"{nonces.max_entries} nonces, so it forgot older seconds); sign closer to sending")
    return allow(GUARD) if first else _refuse("control-plane token replayed")


def check_body(keyring: Keyring, head: RequestHead, token: Token, body: bytes | str | None, nonces: NonceCache, *,
               now: float | None = None) -> Decision:
    """The rest, once the body is there (``token`` as :func:`check_head` allowed it)."""
    digest = body_digest(body)
    if token.version == VERSION:
        if hmac.compare_digest(digest, token.body_sha256):
            return allow(GUARD)
        return _refuse("request body does not match its control-plane token")
    if not _mac_matches(keyring, token.mac, lambda key: _legacy_mac(key, head.method, head.target, digest,
                                                                    token.timestamp, token.nonce)):
        return _refuse("control-plane token does not match (wrong secret, or method, path, query or body changed)")
    return _spend(nonces, token, time.time() if now is None else now)


def verify(keyring: Keyring, head: RequestHead, body: bytes | str | None, token: str | None, nonces: NonceCache, *,
           identity: ServerIdentity, max_age_s: float = DEFAULT_MAX_AGE_S, accept_sgh1: bool = False,
           now: float | None = None) -> Decision:
    """The whole check of one request: ALLOW when its token is valid, fresh, unused and made for this server."""
    decision, parsed = check_head(keyring, head, token, nonces, identity=identity, max_age_s=max_age_s,
                                  accept_sgh1=accept_sgh1, now=now)
    if parsed is None or not decision.allows:
        return decision
    return check_body(keyring, head, parsed, body, nonces, now=now)


# ---------------------------------------------------------------- answers


def _answer_mac(key: bytes, request_mac: str, status: int, body: bytes) -> str:
    message = f"{VERSION}-answer\n{request_mac}\n{status}\n{body_digest(body)}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_answer(keyring: Keyring, token: Token, status: int, body: bytes) -> str:
    """The answer header for a request ``token`` admitted: bound to that request (its MAC), the status and body."""
    return f"{VERSION}.{_answer_mac(keyring.signing, token.mac, status, body)}"


def check_answer(keyring: Keyring, sent_token: str, status: int, answer_token: str | None, body: bytes) -> Decision:
    """ALLOW an answer to our signed request that the server signed for it; REJECT 502 otherwise. An error answer
    (400 and up) needs no signature: whoever could forge one could as well drop the connection, and the client
    treats it as the failure it is."""
    if status >= 400:
        return allow(GUARD)
    sent = read_token(sent_token)
    if sent is None:
        return _refuse("cannot check the answer: the request's own token is malformed", 502)
    version, _, mac = (answer_token or "").partition(".")
    if version != VERSION or not _hex(mac, 64):
        return _refuse("the bootstrap server's answer is not signed (a server without the secret, an sglang-harden "
                       "from before issue 39, or a forged answer)", 502)
    if not _mac_matches(keyring, mac, lambda key: _answer_mac(key, sent.mac, status, body)):
        return _refuse("the bootstrap server's answer does not match its signature (wrong secret, or status or "
                       "body changed on the way)", 502)
    return allow(GUARD)


# ---------------------------------------------------------------- replay cache


class NonceCache:
    """The nonces of tokens still acceptable, grouped by their token's second, at most ``max_entries`` of them.

    A nonce is kept until its token is too old to pass (``ts + max_age_s`` on this clock). At the cap the oldest
    second is forgotten whole and ``floor`` rises to it: from then on every token of that second or older is
    refused. So a forgotten nonce can never be replayed, memory stays bounded, and under a flood the cache keeps
    serving fresh tokens; what shrinks is how old a token may be on arrival (``max_entries`` / the rate of signed
    requests). The floor also covers a wall clock that steps back.
    """

    def __init__(self, max_age_s: float, max_entries: int = DEFAULT_MAX_NONCES) -> None:
        if max_entries < 1 or not max_age_s > 0:
            raise ValueError("a replay cache needs max_entries >= 1 and max_age_s > 0")
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self.floor: int | None = None
        self._seconds: dict[int, set[str]] = {}
        self._order: list[int] = []  # heap of the keys of _seconds
        self._size = 0
        self._lock = threading.Lock()

    def first_use(self, timestamp: int, nonce: str, now: float) -> bool | None:
        """True: first use (now remembered); False: a replay; None: the token's second is one the cache forgot
        (or older), so a replay cannot be ruled out."""
        with self._lock:
            while self._order and self._order[0] < now - self.max_age_s:
                self._forget_oldest()
            if self.floor is not None and timestamp <= self.floor:
                return None
            if nonce in self._seconds.get(timestamp, ()):
                return False
            while self._size >= self.max_entries:
                if timestamp <= self._forget_oldest():
                    return None
            if timestamp not in self._seconds:
                self._seconds[timestamp] = set()
                heappush(self._order, timestamp)
            self._seconds[timestamp].add(nonce)
            self._size += 1
            return True

    def _forget_oldest(self) -> int:
        """Forget the oldest second's nonces; every token of that second or older is refused from now on."""
        second = heappop(self._order)
        self._size -= len(self._seconds.pop(second))
        self.floor = second if self.floor is None else max(self.floor, second)
        return self.floor

    def size(self) -> int:
        return self._size
