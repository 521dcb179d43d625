"""Generated PD side-channel messages for the wire fuzzing: each message type of each backend and role, well formed
(fields varied, the optional trailing frames of older senders cut) or mutated: frames truncated, dropped,
duplicated, swapped, appended, replaced by empty / non-ASCII / huge / negative / almost-decimal / random bytes, one
byte flipped, the type frame replaced. Random frame lists for the types no listener knows.

Hypothesis drives it with one seed per example (:func:`messages`): a message built from Hypothesis' own
strategies costs 1.5-2 ms to draw, one built from a seeded ``random.Random`` about 0.3 ms, and the in-process
suites run every type of every backend and role on two CI pins in about a minute. A failing example is printed as
the frames it produced (and its seed)."""

from __future__ import annotations

import random
from collections.abc import Callable

import wire_messages as m
from hypothesis import strategies as st

PREFILL_KINDS = ("registration", "transfer_info", "abort", "watermark", "staging_rsp", "bootstrap", "unknown")
DECODE_KINDS = ("aux_data", "status", "abort_ack", "staging_req", "chunk_ready", "unknown")
KNOWN_ROOMS = (1, 2, 3, 7)

JUNK = [
    b"", b"\xff\xfe", b"\x00", b"None", b"-1", b"-0", b"01", b" 1", b"1 ", b"1_0", b"+1", b"0x10", b"1e3", b"nan",
    b"9" * 30, b"9" * 5000, str(2**63).encode(), str(2**64).encode(), str(2**31).encode(), str(-(2**63) - 1).encode(),
    b"\xd9\xa1", "٣".encode(), b"host", b"host:", b":1", b"h:99999", b"h:-1", b"a:b:c", b"[::1]:5", b"x" * 300,
    b"ABORT", b"ABORT_ACK", b"AUX_DATA", b"KV_STATUS", m.MORI_GUARD, m.NIXL_GUARD, b"WATERMARK", b"BOOTSTRAP",
    b"STAGING_REQ", b"STAGING_RSP", b"CHUNK_READY", b"\x00\x00\x00\x01", b"\xff\xff\xff\xff", b"\x08\x00\x00\x00",
]
IPS = [m.DECODE_IP, "10.6.6.6", "127.0.0.1", "decode-host", "::1"]
PORTS = [m.DECODE_PORT, 16001, 0, 65535, 65536, 70000]


def junk(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.6:
        return rng.choice(JUNK)
    if pick < 0.8:
        return rng.randbytes(rng.randint(0, 40))
    return str(rng.randint(-(2**70), 2**70) >> rng.randint(0, 70)).encode()


def _room(rng: random.Random) -> int:
    return rng.choice(KNOWN_ROOMS) if rng.random() < 0.7 else rng.randint(-(2**64), 2**65)


def _key(backend: str, rng: random.Random) -> tuple[str, tuple[str, int]]:
    """A registration / transfer-info key and its reply address: the prelude's two decodes (mostly from where they
    registered), a new decode, or a malformed key."""
    pick = rng.random()
    if pick < 0.35:
        key, home = m.KEYS[backend], (m.DECODE_IP, m.DECODE_PORT)
    elif pick < 0.6:
        key, home = m.OTHER_KEYS[backend], (m.OTHER_IP, m.OTHER_PORT)
    elif pick < 0.85:
        host = f"10.0.1.{rng.randint(1, 250)}"
        key, home = (f"{host}:{rng.randint(15000, 15100)}" if backend == "mooncake" else
                     f"{backend}-{rng.randint(0, 10**6)}"), (host, 40001)
        return key, home
    else:
        return rng.choice(["x", "host:99999", "a:b:1", "h:"]), _endpoint(rng)
    return key, home if rng.random() < 0.8 else _endpoint(rng)


def _endpoint(rng: random.Random) -> tuple[str, int]:
    pick = rng.random()
    if pick < 0.5:
        return m.DECODE_IP, m.DECODE_PORT
    if pick < 0.7:
        return m.OTHER_IP, m.OTHER_PORT
    return rng.choice(IPS), rng.choice(PORTS) if rng.random() < 0.7 else rng.randint(0, 70000)


def _small(rng: random.Random, hi: int = 4) -> int:
    return rng.randint(0, hi)


def well_formed(backend: str, kind: str, rng: random.Random) -> list[bytes]:
    """A message as a sender of some 0.5.19..0.5.23 release builds it, fields varied."""
    ip, port = _endpoint(rng)
    key, (key_ip, key_port) = _key(backend, rng)
    build: dict[str, Callable[[], list[bytes]]] = {
        "registration": lambda: m.registration(
            backend, key, key_ip, key_port, rng.choice([0xAAAA0000, 0xDEAD0000]), rng.randint(1, 3),
            rng.randint(0, 3), rng.choice([(1, 0)] * 4 + [(2, 0), (2, 1), (1, 1)]), rng.choice([256, 128, 0]),
            None if rng.random() < 0.7 else rng.randint(9, 24)),
        "transfer_info": lambda: m.transfer_info(
            backend, _room(rng), key, rng.randint(1, 3), rng.randint(0, 8), rng.randint(-1, 70),
            rng.random() < 0.2, key_ip, key_port, _small(rng, 5), None if rng.random() < 0.7 else rng.randint(5, 10)),
        "abort": lambda: m.abort(_room(rng), None if rng.random() < 0.1 else ip, port,
                                 None if rng.random() < 0.3 else _small(rng, 3)),
        "bootstrap": lambda: m.bootstrap(_room(rng), ip, port),
        "watermark": lambda: m.watermark(_small(rng, 5), _small(rng, 5)),
        "staging_rsp": lambda: m.staging_rsp(_room(rng)),
        "aux_data": lambda: m.aux_data(_room(rng), _small(rng, 3),
                                       rng.randint(0, 80) if rng.random() < 0.8 else rng.randint(0, 2**63),
                                       rng.randbytes(rng.randint(0, 12))),
        "status": lambda: m.status(backend, _room(rng), _small(rng, 5), _small(rng),
                                   None if rng.random() < 0.5 else rng.choice(["", "boom", "é"])),
        "abort_ack": lambda: m.abort_ack(_room(rng), None if rng.random() < 0.2 else _small(rng),
                                         None if rng.random() < 0.3 else _small(rng, 3)),
        "staging_req": lambda: m.staging_req(_room(rng)),
        "chunk_ready": lambda: m.chunk_ready(_room(rng)),
        "unknown": lambda: [junk(rng) for _ in range(rng.randint(0, 12))],
    }
    return build[kind]()


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    frames = list(frames)
    for _ in range(rng.randint(1, 3)):
        n = len(frames)
        i = rng.randint(0, max(n - 1, 0))
        op = rng.choice(["truncate", "drop", "extra", "replace", "replace", "flip", "swap", "dup", "head"])
        if op == "truncate":
            frames = frames[:i]
        elif op == "drop" and n:
            del frames[i]
        elif op == "extra":
            frames += [junk(rng) for _ in range(rng.randint(1, 3))]
        elif op == "replace" and n:
            frames[i] = junk(rng)
        elif op == "flip" and n and frames[i]:
            j = rng.randrange(len(frames[i]))
            frames[i] = frames[i][:j] + bytes([frames[i][j] ^ rng.randint(1, 255)]) + frames[i][j + 1:]
        elif op == "swap" and n > 1:
            j = rng.randrange(n)
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "dup" and n:
            frames.insert(i, frames[i])
        elif op == "head" and n:
            frames[0] = junk(rng)
    return frames


def generate(backend: str, kind: str, seed: int) -> list[bytes]:
    """Well formed (half), or mutated."""
    rng = random.Random(seed)
    frames = well_formed(backend, kind, rng)
    return frames if rng.random() < 0.5 else mutate(frames, rng)


SIGNERS = ("unsigned", "S1", "S2", "forged")  # forged: signed with a key that is not the deployment's


def messages(backend: str, kind: str) -> st.SearchStrategy[tuple[list[bytes], str, bool]]:
    """(frames, who signs them, whether the rank port enforces authentication), from one drawn seed."""
    return st.integers(0, 2**64 - 1).map(
        lambda seed: (generate(backend, kind, seed), SIGNERS[seed % 4], bool(seed >> 2 & 1)))
