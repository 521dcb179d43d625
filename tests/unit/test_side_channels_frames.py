"""The side-channel attack material (testbed/side_channels.py) builds the frames the e2e's attacker sends: its
destination's layout and pointers land where each backend's parser reads them."""

from __future__ import annotations

import struct

from sglang_harden.testbed.side_channels import (
    NIXL_GUARD,
    Destination,
    Layout,
    copy_registration,
    copy_transfer_info,
    is_registration,
    is_transfer_info,
    nixl_copy_registration,
    nixl_copy_transfer_info,
    pages_of,
)


def _q(*values: int) -> bytes:
    return struct.pack(f"{len(values)}Q", *values)


def _i(*values: int) -> bytes:
    return struct.pack(f"{len(values)}i", *values)


MOONCAKE_REG = [b"None", b"127.0.0.1", b"5000", b"127.0.0.1:17000", _q(0x1000, 0x9000), _q(0x20000), b"", b"0",
                b"1", b"256", b"", b"", b"", b"", b"", b"", b"1", b"0", b"", _q(256, 128)]
NIXL_REG = [NIXL_GUARD, b"None", b"127.0.0.1", b"5000", b"victim-agent", b"meta", _q(0x1000, 0x9000), _q(0x20000),
            b"", b"3", b"1", b"0", b"256", b"", b"", b"", b"", b"600", b"VRAM,VRAM", _q(256, 128), b"", b"", b"1",
            b"0", b""]


def test_mooncake_copy_frames() -> None:
    layout = Layout.of(MOONCAKE_REG)
    assert layout == Layout((256, 128), 1) and is_registration(MOONCAKE_REG)
    dest = Destination("127.0.0.1:16000", 0x100000, layout, pages=4)
    reg = copy_registration(MOONCAKE_REG, dest, 7000)
    assert reg[1:4] == [b"127.0.0.1", b"7000", b"127.0.0.1:16000"]
    assert struct.unpack("2Q", reg[4]) == (0x100000, 0x100000 + 256 * 4)
    assert struct.unpack("Q", reg[5]) == (0x100000 + 384 * 4,)
    info = [b"42", b"127.0.0.1", b"5000", b"127.0.0.1:17000", _i(5, 6, 7, 8), b"3", b"", b"1", b"0", b""]
    assert is_transfer_info(42)(info) and pages_of(info) == 4
    copy = copy_transfer_info(info, dest, 7000)
    assert copy[3] == b"127.0.0.1:16000" and copy[4] == _i(0, 1, 2, 3) and copy[5] == b"0" and copy[7] == b"2"


def test_nixl_copy_frames() -> None:
    layout = Layout.of(NIXL_REG)
    assert layout == Layout((256, 128), 1) and is_registration(NIXL_REG)
    dest = Destination("attacker-agent", 0x100000, layout, pages=4)
    reg = nixl_copy_registration(NIXL_REG, dest, b"attacker-meta", 7000)
    assert reg[0] == NIXL_GUARD and reg[1] == b"None"
    assert reg[2:6] == [b"127.0.0.1", b"7000", b"attacker-agent", b"attacker-meta"]
    assert struct.unpack("2Q", reg[6]) == (0x100000, 0x100000 + 256 * 4)
    assert reg[9] == b"0" and reg[17] == b"4" and reg[18] == b"DRAM,DRAM" and reg[19] == NIXL_REG[19]
    info = [NIXL_GUARD, b"42", b"127.0.0.1", b"5000", b"victim-agent", _i(5, 6, 7), b"3", b"1", b"", b"0", b"0"]
    assert is_transfer_info(42)(info) and not is_transfer_info(43)(info) and pages_of(info) == 3
    copy = nixl_copy_transfer_info(info, Destination("attacker-agent", 0x100000, layout, pages=3), 7000)
    assert copy[0] == NIXL_GUARD and copy[1] == b"42"
    assert copy[2:5] == [b"127.0.0.1", b"7000", b"attacker-agent"]
    assert copy[5] == _i(0, 1, 2) and copy[6] == b"0" and copy[7] == b"2"
