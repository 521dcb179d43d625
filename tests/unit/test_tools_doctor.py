"""doctor's code detectors on small synthetic SGLang trees: vanilla shapes, backports under other names,
and the compat layer missing. The real wheels are checked in tests/integration/test_doctor_wheels.py."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_harden.cli import main
from sglang_harden.tools import _protections as P
from sglang_harden.tools._source import SourceTree

REQ = """
class Req:
    def set_finish_with_abort(self, error_msg):
        self.{field} = FINISH_ABORT(error_msg)
"""
UTILS = """
def is_aborted(req):
    return isinstance(req.to_finish, FINISH_ABORT) or isinstance(req.finished_reason, FINISH_ABORT)
"""
PREFILL_VANILLA = """
from sglang.srt.disaggregation.utils import is_aborted

class PrefillBootstrapQueue:
    def add(self, req, num_kv_heads):
        if not self.create_sender(req, num_kv_heads):
            return
        self.queue.append(req)

    def create_sender(self, req, num_kv_heads):
        req.sender = object()
        return True

class SchedulerDisaggregationPrefillMixin:
    def process_batch_result_disagg_prefill(self, batch, result):
        for req in batch.reqs:
            if req.inflight_middle_chunks <= 0:
                req.output_ids.append(1)
                self.send_kv_chunk(req, last_chunk=True)
            else:
                if is_aborted(req):
                    continue
                self.send_kv_chunk(req, last_chunk=False)

    def send_kv_chunk(self, req, last_chunk=False, end_idx=None):
        pass
"""
# A backport under other names: a local helper, a guard in the send itself.
PREFILL_PATCHED = """
def _rejected(req):
    return req.to_finish is not None

class PrefillBootstrapQueue:
    def add(self, req, num_kv_heads):
        if self._pending_reject(req):
            self.retire(req)
            return
        self.queue.append(req)

    def _pending_reject(self, req):
        return _rejected(req)

class SchedulerDisaggregationPrefillMixin:
    def process_batch_result_disagg_prefill(self, batch, result):
        for req in batch.reqs:
            self.send_kv_chunk(req, last_chunk=True)

    def send_kv_chunk(self, req, last_chunk=False, end_idx=None):
        if _rejected(req):
            return
        pass
"""
DECODE_VANILLA = """
class DecodePreallocQueue:
    def add(self, req, is_retracted=False):
        self.queue.append(req)

class DecodeTransferQueue:
    def _commit_transfer_to_req(self, decode_req):
        if actual_room != expected_room:
            prepare_abort(decode_req.req, "room mismatch")
            return
        decode_req.req.output_ids.append(1)
"""
DECODE_PATCHED = """
from sglang.srt.disaggregation.utils import is_aborted

class DecodePreallocQueue:
    def add(self, req, is_retracted=False):
        if not is_retracted and is_aborted(req):
            return
        self.queue.append(req)

class DecodeTransferQueue:
    def _commit_transfer_to_req(self, decode_req):
        self._check_coverage(decode_req)

    def _check_coverage(self, decode_req):
        if self.metadata.sent_tokens(decode_req) != len(decode_req.req.origin_input_ids):
            prepare_abort(decode_req.req, "short transfer")
"""


def make_tree(root: Path, prefill: str, decode: str, field: str = "to_finish", version: str = "9.9.9") -> Path:
    files = {
        "sglang/__init__.py": "",
        "sglang/_version.py": f"__version__ = version = {version!r}\n",
        "sglang/srt/managers/schedule_batch.py": REQ.format(field=field),
        "sglang/srt/disaggregation/utils.py": UTILS,
        "sglang/srt/disaggregation/prefill.py": prefill,
        "sglang/srt/disaggregation/decode.py": decode,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_vanilla_shapes_are_missing(tmp_path: Path) -> None:
    tree = SourceTree(make_tree(tmp_path, PREFILL_VANILLA, DECODE_VANILLA))
    assert tree.version() == "9.9.9"
    assert P.detect_door_rejection(tree).status == P.NO
    retire = P.detect_abort_retirement(tree)
    assert retire.status == P.NO and "unguarded final send" in retire.evidence[0]
    assert P.detect_coverage_check(tree).status == P.NO


def test_backport_under_other_names_is_recognised(tmp_path: Path) -> None:
    tree = SourceTree(make_tree(tmp_path, PREFILL_PATCHED, DECODE_PATCHED))
    door = P.detect_door_rejection(tree)
    assert door.status == P.YES, door
    assert P.detect_abort_retirement(tree).status == P.YES
    coverage = P.detect_coverage_check(tree)
    assert coverage.status == P.YES and "_check_coverage" in coverage.evidence[0]


def test_one_door_only_is_partial(tmp_path: Path) -> None:
    tree = SourceTree(make_tree(tmp_path, PREFILL_VANILLA, DECODE_PATCHED))
    door = P.detect_door_rejection(tree)
    assert door.status == P.PARTIAL and "prefill" in door.detail


def test_reading_the_wrong_field_is_not_evidence(tmp_path: Path) -> None:
    """On a pin whose set_finish_with_abort writes finished_reason, a door testing only to_finish is blind."""
    prefill = PREFILL_PATCHED.replace("req.to_finish is not None", "req.to_finish is not None")
    tree = SourceTree(make_tree(tmp_path, prefill, DECODE_VANILLA, field="finished_reason"))
    assert P.abort_fields(tree) == {"finished_reason"}
    assert P.detect_door_rejection(tree).status == P.NO


def test_unknown_layout_is_unknown_not_no(tmp_path: Path) -> None:
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    natives = P.inspect_tree(SourceTree(tmp_path))
    assert natives["door_rejection"].status == P.UNKNOWN
    assert natives["abort_retirement"].status == P.UNKNOWN


def test_cli_json_and_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_tree(tmp_path, PREFILL_PATCHED, DECODE_PATCHED)
    code = main(["doctor", "--sglang-root", str(tmp_path), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["ok"] is False
    rows = {p["key"]: p for p in data["protections"]}
    assert rows["door_rejection"]["native"]["status"] == "yes"
    assert rows["door_rejection"]["verdict"].startswith("native")
    assert "bootstrap_auth" in data["missing"]


def test_compat_layer_missing_is_said_plainly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tree(tmp_path, PREFILL_VANILLA, DECODE_VANILLA)
    monkeypatch.setitem(sys.modules, "sglang_harden.compat", None)
    code = main(["doctor", "--sglang-root", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "sglang-harden compat layer not available" in out
    assert "sglang-harden  " in out  # the column exists
    assert "MISSING" in out and "Traceback" not in out


def test_switches_from_env_and_launch_args(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tree(tmp_path, PREFILL_VANILLA, DECODE_VANILLA)
    environ = tmp_path / "sglang" / "srt" / "environ.py"
    environ.write_text("class Envs:\n    SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES = EnvInt(0)\n")
    conn = tmp_path / "sglang" / "srt" / "disaggregation" / "mooncake"
    conn.mkdir()
    (conn / "conn.py").write_text("x = envs.SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES.get()\n")
    monkeypatch.setenv("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES", "128")
    main(["doctor", "--sglang-root", str(tmp_path), "--json", "--launch-args", "--kv-canary log"])
    rows = {p["key"]: p for p in json.loads(capsys.readouterr().out)["protections"]}
    batch = rows["transfer_batch_bound"]
    assert batch["native"]["status"] == "opt-in" and batch["switch_value"] == "128"
    assert batch["verdict"] == "native (switched on)"


def test_no_sglang_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--sglang-root", str(tmp_path)]) == 2
    assert "no sglang package" in capsys.readouterr().out


def test_activation_switched_off_supplies_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_tree(tmp_path, PREFILL_VANILLA, DECODE_VANILLA, version="0.5.19")
    monkeypatch.setenv("SGLANG_HARDEN_ACTIVATE", "0")
    main(["doctor", "--sglang-root", str(tmp_path), "--json"])
    rows = json.loads(capsys.readouterr().out)["protections"]
    assert not any(r["supplied_by_harden"] for r in rows)


@pytest.mark.parametrize("launch_args,environ,expected", [
    ([], {}, "unauthenticated"),
    ([], {"SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE": "/etc/pd.secret"}, "enforce"),
    (["--harden-bootstrap-secret-file", "/etc/pd.secret"], {}, "enforce"),
    (["--harden-bootstrap-secret-file", "/etc/pd.secret", "--harden-bootstrap-auth", "log"], {}, "log"),
    ([], {"SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE": "/etc/pd.secret", "SGLANG_HARDEN_BOOTSTRAP_AUTH": "off"},
     "unauthenticated"),
])
def test_control_plane_auth_is_reported_truthfully(launch_args: list[str], environ: dict[str, str],
                                                   expected: str) -> None:
    from sglang_harden.tools.doctor import control_plane_auth, guard_modes

    assert control_plane_auth(launch_args, environ, guard_modes(environ)[0]) == expected
