"""doctor on the real SGLang releases, row by row against ../shared/notes/upstream.md.

Trees come from, in order: the pin's venv (``$SGLANG_HARDEN_HOME/venvs/<pin>``), an unpacked wheel cached
under ``$SGLANG_HARDEN_HOME/wheel-src/<pin>``, or ``pip download --no-deps sglang==<pin>`` (PyPI) unpacked
there. No import of SGLang happens: doctor reads the code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sglang_harden.tools import _protections as P
from sglang_harden.tools._source import SourceTree

HOME = Path(os.environ.get("SGLANG_HARDEN_HOME", Path.home() / ".cache" / "sglang-harden"))

# status per protection, from upstream.md's table (and the "still open in 0.5.23" list for the last three)
EXPECTED: dict[str, dict[str, str]] = {
    "0.5.19": {
        "door_rejection": P.NO,
        "abort_retirement": P.NO,
        "coverage_check": P.NO,
        "kv_checksum": P.NO,
        "deferred_release": P.OPT_IN,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.PARTIAL,
        "transfer_batch_bound": P.NO,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
    },
    "0.5.20": {
        "door_rejection": P.NO,
        "abort_retirement": P.YES,
        "coverage_check": P.NO,
        "kv_checksum": P.NO,
        "deferred_release": P.OPT_IN,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.PARTIAL,
        "transfer_batch_bound": P.OPT_IN,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
    },
    "0.5.21": {
        "door_rejection": P.YES,
        "abort_retirement": P.YES,
        "coverage_check": P.NO,
        "kv_checksum": P.OPT_IN,
        "deferred_release": P.YES,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.YES,
        "transfer_batch_bound": P.OPT_IN,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
    },
    "0.5.23": {
        "door_rejection": P.YES,
        "abort_retirement": P.YES,
        "coverage_check": P.NO,
        "kv_checksum": P.OPT_IN,
        "deferred_release": P.YES,
        "kv_canary": P.OPT_IN,
        "abort_ack": P.YES,
        "transfer_batch_bound": P.OPT_IN,
        "decode_abort_notify": P.NO,
        "bootstrap_auth": P.NO,
    },
}
DETAILS = {
    ("0.5.19", "abort_ack"): "clear() drops the ack target",
    ("0.5.20", "abort_ack"): "clear() drops the ack target",
    ("0.5.21", "deferred_release"): "mooncake, nixl",
    ("0.5.23", "deferred_release"): "mooncake, nixl, mori",
    ("0.5.23", "abort_ack"): "generation-tagged",
}


def sglang_tree(pin: str) -> Path:
    venv = HOME / "venvs" / pin / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    installed = venv / "site-packages"
    if (installed / "sglang").is_dir() and (installed / f"sglang-{pin}.dist-info").is_dir():
        return installed
    unpacked = HOME / "wheel-src" / pin
    if (unpacked / "sglang" / "srt").is_dir():
        return unpacked
    return _download(pin, unpacked)


def _download(pin: str, dest: Path) -> Path:
    cache = HOME / "wheel-cache"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{pin}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"sglang=={pin}", "-d", str(cache)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        wheels = sorted(cache.glob(f"sglang-{pin}-*.whl"))
        if proc.returncode != 0 or not wheels:
            pytest.skip(f"sglang=={pin} not available here (no venv, no cache, download failed): {proc.stderr[-300:]}")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheels[-1]) as zf:
        zf.extractall(tmp, [n for n in zf.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


@pytest.mark.parametrize("pin", sorted(EXPECTED))
def test_doctor_row_by_row(pin: str) -> None:
    tree = SourceTree(sglang_tree(pin))
    assert tree.version() == pin
    natives = P.inspect_tree(tree)
    got = {key: native.status for key, native in natives.items()}
    assert got == EXPECTED[pin]
    for (detail_pin, key), text in DETAILS.items():
        if detail_pin == pin:
            assert text in natives[key].detail, natives[key]


def test_patched_0519_door_is_recognised(tmp_path: Path) -> None:
    """A backport is judged by its code: add the prefill-door check to 0.5.19's own source."""
    src = SourceTree(sglang_tree("0.5.19")).root / "sglang"
    for rel in ("_version.py", "srt/managers/schedule_batch.py", "srt/disaggregation"):
        target = tmp_path / "sglang" / rel
        if (src / rel).is_dir():
            shutil.copytree(src / rel, target)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src / rel, target)
    prefill = tmp_path / "sglang" / "srt" / "disaggregation" / "prefill.py"
    text = prefill.read_text()
    anchor = "    def add(self, req: Req, num_kv_heads: int) -> None:\n"
    assert anchor in text
    prefill.write_text(text.replace(anchor, anchor + "        if is_aborted(req):\n            return\n", 1))
    door = P.detect_door_rejection(SourceTree(tmp_path))
    assert door.status == P.PARTIAL and door.detail.startswith("decode"), door
