"""Process groups the testbed starts: launch, track, and kill exactly those groups.

Every server/router runs in its own session (``start_new_session=True``), so its pid is its process-group id
and SGLang's spawned scheduler/detokenizer children share it. Stopping = SIGTERM to that group, wait,
SIGKILL. Every started group is recorded in memory (and appended to ``$SGLANG_HARDEN_TESTBED_PIDFILE`` when
set) so a test session can prove at its end that nothing it started is still alive. An ``atexit`` handler
kills whatever a crashing caller left behind.
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

PIDFILE_ENV = "SGLANG_HARDEN_TESTBED_PIDFILE"

_lock = threading.Lock()
_live: dict[int, subprocess.Popen[bytes]] = {}
_started: list[int] = []
_ports_handed_out: set[int] = set()


def _live_members(pgid: int) -> list[int] | None:
    """Pids of the group's processes that are not zombies (None when /proc cannot be read)."""
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    members = []
    for entry in entries:
        try:
            state_and_rest = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(state_and_rest[2]) == pgid and state_and_rest[0] not in ("Z", "X"):
            members.append(int(entry))
    return members


def group_alive(pgid: int) -> bool:
    """True while any non-zombie process of the group exists (our own exited children are reaped first)."""
    with _lock:
        proc = _live.get(pgid)
    if proc is not None:
        proc.poll()
    members = _live_members(pgid)
    if members is not None:
        return bool(members)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def started_groups() -> list[int]:
    with _lock:
        return list(_started)


def alive_groups() -> list[int]:
    return [g for g in started_groups() if group_alive(g)]


def spawn(
    cmd: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session with stdout+stderr appended to ``log_path``; record its group."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
    with _lock:
        _live[proc.pid] = proc
        _started.append(proc.pid)
    pidfile = os.environ.get(PIDFILE_ENV)
    if pidfile:
        with open(pidfile, "a") as fh:
            fh.write(f"{proc.pid} {' '.join(cmd[:4])}\n")
    return proc


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_gone(pgids: Sequence[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    remaining = list(pgids)
    while remaining and time.monotonic() < deadline:
        remaining = [g for g in remaining if group_alive(g)]
        if remaining:
            time.sleep(0.1)
    return [g for g in remaining if group_alive(g)]


def kill_groups(pgids: Sequence[int], term_timeout: float = 10.0, kill_timeout: float = 10.0) -> list[int]:
    """SIGTERM the groups, wait, SIGKILL what is left; returns groups still alive after that (should be none)."""
    pgids = [g for g in pgids if group_alive(g)]
    for pgid in pgids:
        _signal_group(pgid, signal.SIGTERM)
    left = _wait_gone(pgids, term_timeout)
    for pgid in left:
        _signal_group(pgid, signal.SIGKILL)
    left = _wait_gone(left, kill_timeout)
    with _lock:
        for pgid in pgids:
            if pgid not in left:
                proc = _live.pop(pgid, None)
                if proc is not None:
                    proc.poll()
    return left


def detach(pgid: int) -> None:
    """Stop tracking a group (it outlives this process: ``sglang-harden testbed start``)."""
    with _lock:
        _live.pop(pgid, None)


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), None when gone.

    Recorded next to a pid so a later ``stop`` can tell the process it started from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _kill_all_at_exit() -> None:
    with _lock:
        groups = list(_live)
    if groups:
        kill_groups(groups, term_timeout=3.0, kill_timeout=5.0)


atexit.register(_kill_all_at_exit)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _candidate_ports(span: int) -> list[int]:
    """Ports below the kernel's ephemeral range, so no outgoing socket can take one while a server boots."""
    low, _ = _ephemeral_range()
    top = min(low, 65535) - span - 1
    bottom = 20000 if top - 20000 > 2000 else 1024
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    return rng.sample(range(bottom, top), k=200)


def free_port(span: int = 1) -> int:
    """A loopback port (with ``span - 1`` free neighbours) outside the ephemeral range, not handed out before."""
    for port in _candidate_ports(span):
        block = range(port, port + span)
        with _lock:
            if any(p in _ports_handed_out for p in block):
                continue
        if all(_bindable(p) for p in block):
            with _lock:
                _ports_handed_out.update(block)
            return port
    raise RuntimeError("no free loopback port found")
