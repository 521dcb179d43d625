"""Well-formed PD side-channel messages, as SGLang 0.5.23's senders build them (a superset of 0.5.19's: the later
frames are optional trailing fields every earlier listener ignores). Stdlib + numpy; used by the wire fuzzing."""

from __future__ import annotations

import struct

import numpy as np

NIXL_GUARD, MORI_GUARD = b"NixlMsgGuard", b"MoriMsgGuard"
DECODE_IP, DECODE_PORT = "10.0.0.5", 40001
OTHER_IP, OTHER_PORT = "10.6.6.6", 16001  # another decode (or an attacker's)
KEYS = {"mooncake": "10.0.0.5:15001", "nixl": "agent-decode-0", "mori": "engine-decode-0"}
OTHER_KEYS = {"mooncake": "10.6.6.6:16001", "nixl": "agent-attacker", "mori": "engine-attacker"}
SUCCESS, FAILED = 4, 0


def _b(value: object) -> bytes:
    return str(value).encode("ascii")


def _q(values: list[int]) -> bytes:
    return b"".join(struct.pack("Q", v) for v in values)


def registration(backend: str, key: str | None = None, ip: str = DECODE_IP, port: int = DECODE_PORT,
                 kv_ptr: int = 0xAAAA0000, n_kv: int = 2, n_aux: int = 2, dcp: tuple[int, int] = (1, 0),
                 item_len: int = 256, trailing: int | None = None) -> list[bytes]:
    """A decode rank's registration; ``trailing``: keep only that many payload frames (older senders)."""
    key = key or KEYS[backend]
    kv, aux = _q([kv_ptr + i * 0x1000 for i in range(n_kv)]), _q([0xBBBB0000 + i * 0x100 for i in range(n_aux)])
    if backend == "mooncake":
        payload = [b"None", ip.encode(), _b(port), key.encode(), kv, aux, b"", b"0", b"1", _b(item_len), b"", b"",
                   struct.pack(f"{n_kv}I", *range(n_kv)), b"", b"", b"", _b(dcp[0]), _b(dcp[1]), b"",
                   _q([item_len] * n_kv)]
        head: list[bytes] = []
    elif backend == "nixl":
        payload = [b"None", ip.encode(), _b(port), key.encode(), b"nixl-metadata:" + key.encode(), kv, aux, b"",
                   b"0", b"1", b"0", _b(item_len), b"", b"", b"", b"", _b(64), ",".join(["VRAM"] * n_kv).encode(),
                   _q([item_len] * n_kv), b"", struct.pack(f"{n_kv}I", *range(n_kv)), _b(dcp[0]), _b(dcp[1]), b""]
        head = [NIXL_GUARD]
    else:
        import msgspec

        descs = msgspec.msgpack.encode([b"mem:%d" % i for i in range(n_kv)])
        aux_descs = msgspec.msgpack.encode([b"mem:%d" % i for i in range(n_aux)]) if n_aux else b""
        payload = [b"None", ip.encode(), _b(port), b"engine:" + key.encode(), descs, aux_descs, b"", b"0", b"1",
                   b"0", _b(item_len), b"", b"", _b(dcp[0]), _b(dcp[1]), b"", struct.pack(f"<{n_kv}I", *range(n_kv))]
        head = [MORI_GUARD]
    if trailing is not None:
        payload = payload[:trailing]
    return head + payload


def transfer_info(backend: str, room: int, key: str | None = None, required: int = 1, pages: int = 4,
                  aux_index: int = 0, dummy: bool = False, ip: str = DECODE_IP, port: int = DECODE_PORT,
                  prefix_len: int = 0, trailing: int | None = None) -> list[bytes]:
    key = key or KEYS[backend]
    indices = np.arange(pages, dtype=np.int32).tobytes()
    if backend == "mooncake":
        payload = [_b(room), ip.encode(), _b(port), key.encode(), b"" if dummy else indices,
                   b"" if dummy else _b(aux_index), b"", _b(required), _b(prefix_len),
                   b"" if dummy else indices]
        head: list[bytes] = []
    elif backend == "nixl":
        payload = [_b(room), ip.encode(), _b(port), key.encode(), b"" if dummy else indices, _b(aux_index),
                   _b(required), b"", _b(prefix_len), _b(int(dummy))]
        head = [NIXL_GUARD]
    else:
        payload = [_b(room), ip.encode(), _b(port), key.encode(), b"" if dummy else indices,
                   b"" if dummy else _b(aux_index), b"", _b(required), _b(prefix_len) if prefix_len else b""]
        head = [MORI_GUARD]
    if trailing is not None:
        payload = payload[:trailing]
    return head + payload


def abort(room: int, ip: str | None = DECODE_IP, port: int | None = DECODE_PORT,
          generation: int | None = 1) -> list[bytes]:
    frames = [b"ABORT", _b(room)]
    if ip is not None and port is not None:
        frames += [ip.encode(), _b(port)]
        if generation is not None:
            frames.append(_b(generation))
    return frames


def bootstrap(room: int, ip: str = DECODE_IP, port: int = DECODE_PORT) -> list[bytes]:
    return [b"BOOTSTRAP", _b(room), ip.encode(), _b(port)]


def abort_ack(room: int, rank: int | None = 0, generation: int | None = 1) -> list[bytes]:
    frames = [b"ABORT_ACK", _b(room)]
    if rank is not None:
        frames.append(_b(rank))
        if generation is not None:
            frames.append(_b(generation))
    return frames


def status(backend: str, room: int, value: int = SUCCESS, rank: int = 0, reason: str | None = None) -> list[bytes]:
    frames = [_b(room), _b(value), _b(rank)]
    if backend == "nixl":
        return [b"KV_STATUS", *frames, (reason or "").encode()]
    if backend == "mori":
        return [MORI_GUARD, *frames, (reason or "").encode()]
    return frames


def aux_data(room: int, buffer_index: int, aux_index: int, data: bytes) -> list[bytes]:
    return [b"AUX_DATA", _b(room), _b(buffer_index), _b(aux_index), struct.pack(">I", len(data)), data]


def watermark(round_: int = 1, tail: int = 0, session: str = KEYS["mooncake"]) -> list[bytes]:
    return [b"WATERMARK", _b(round_), _b(tail), session.encode()]


def staging_rsp(room: int, session: str = KEYS["mooncake"]) -> list[bytes]:
    return [b"STAGING_RSP", _b(room), b"0", b"0", b"1", b"4096", session.encode()]


def staging_req(room: int, session: str = KEYS["mooncake"]) -> list[bytes]:
    return [b"STAGING_REQ", _b(room), b"0", b"4", session.encode(), b"0"]


def chunk_ready(room: int) -> list[bytes]:
    return [b"CHUNK_READY", _b(room), b"0", b"0", b"4", b"writer-0", b"0"]
