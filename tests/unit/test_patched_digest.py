"""The KV-digest patch's module (``sglang/srt/disaggregation/common/pd_digest.py`` of a patched tree), imported from
the file the series writes, on stand-in schedulers whose KV pools are real torch buffers: what prefill posts for
the rows it sends, what decode decides on each answer of prefill's board (verified, refused, skipped, refused for
lack of a digest), the modes, and that the patched shard is the plugin's, value for value (so patched and plugin
nodes check each other). Needs torch: ``scripts/run_tests.sh`` runs it with a pin's venv python. The real patched
servers are ``tests/e2e/test_patched_incident.py`` (a flipped bit on a real pair).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_patch import load_series_module, make_tree, patched_trees

from sglang_harden.compat.digest_pool import pool_layout
from sglang_harden.guards import checksum
from sglang_harden.kernels.digest import shard_digest
from sglang_harden.tools import patch as P
from sglang_harden.tools._detectors_request import detect_kv_checksum
from sglang_harden.tools._source import SourceTree

torch = pytest.importorskip("torch")

MODULE = "sglang/srt/disaggregation/common/pd_digest.py"
SIZE, HEADS, DIM, LAYERS, N = 64, 2, 16, 3, 20
PREFILL_SLOTS, DECODE_SLOTS = list(range(3, 3 + N)), list(range(40, 40 + N))
ROOM = 4242


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return patched_trees(tmp_path_factory, ("0.5.19", "0.5.23"))


def load(tree: Path, monkeypatch: pytest.MonkeyPatch, mode: str | None = None) -> ModuleType:
    return load_series_module(tree / MODULE, "SGLANG_HARDEN_CHECKSUM", mode, monkeypatch)


def _pool(seed: int | None = None) -> Any:
    gen = torch.Generator().manual_seed(seed or 0)
    make = (lambda: torch.randn((SIZE, HEADS, DIM), generator=gen).to(torch.bfloat16)) if seed is not None else (
        lambda: torch.zeros((SIZE, HEADS, DIM), dtype=torch.bfloat16))
    return SimpleNamespace(k_buffer=[make() for _ in range(LAYERS)], v_buffer=[make() for _ in range(LAYERS)],
                           dtype=torch.bfloat16, page_size=1)


def _scheduler(pool: Any, slots: list[int]) -> Any:
    req_to_token = torch.zeros((2, SIZE), dtype=torch.int32)
    req_to_token[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HEADS),
        ps=SimpleNamespace(attn_tp_rank=0, attn_tp_size=1),
        server_args=SimpleNamespace(host="127.0.0.1"),
        disagg_prefill_bootstrap_queue=SimpleNamespace(bootstrap_port=1),
    )


def _transfer(src: Any, dst: Any) -> None:
    for src_bufs, dst_bufs in ((src.k_buffer, dst.k_buffer), (src.v_buffer, dst.v_buffer)):
        for s, d in zip(src_bufs, dst_bufs, strict=True):
            for a, b in zip(PREFILL_SLOTS, DECODE_SLOTS, strict=True):
                d[b] = s[a]


def _req() -> Any:
    return SimpleNamespace(rid="r1", bootstrap_room=ROOM, origin_input_ids=[1] * N, kv=SimpleNamespace(req_pool_idx=1),
                           disagg_decode_prefix_len=0)


class Board:
    """Stands in for prefill's bootstrap server: what the publisher posted, answered to decode's fetch."""

    def __init__(self, module: ModuleType) -> None:
        self.module, self.posted = module, {}

    def publish(self, shard: Any) -> None:
        self.posted[shard.rank] = shard.values

    def publish_when_ready(self, make: Any) -> None:
        self.publish(make())  # the publisher's thread would make it; here, at once

    def fetch(self, addr: str, room: int, wait_s: float, enough: Any) -> Any:
        return self.module.Fetched(dict(self.posted))


def _published(module: ModuleType, prefill: Any, monkeypatch: pytest.MonkeyPatch) -> Board:
    board = Board(module)
    monkeypatch.setattr(module, "PUBLISHER", board)
    monkeypatch.setattr(module, "fetch_digests", board.fetch)
    module.publish_before_final_send(_scheduler(prefill, PREFILL_SLOTS), _req(), N)
    return board


@pytest.fixture(params=["0.5.19", "0.5.23"])
def digest(request: pytest.FixtureRequest, trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(trees[request.param], monkeypatch)


def test_every_series_carries_the_module() -> None:
    pins = P.available_pins(P.default_patches_dir())
    assert {"0.4.9.post6", "0.4.10.post2", "0.5.23"} <= set(pins)
    for pin in pins:
        assert any(MODULE in p.targets for p in P.load_series(pin, P.default_patches_dir())), pin


def test_a_faithful_transfer_is_verified(digest: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = _pool(seed=5), _pool()
    _published(digest, prefill, monkeypatch)
    _transfer(prefill, decode)
    assert digest.refusal_at_commit(_req(), _scheduler(decode, DECODE_SLOTS), SimpleNamespace(), None) is None


def test_a_flipped_bit_is_refused(digest: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = _pool(seed=5), _pool()
    _published(digest, prefill, monkeypatch)
    _transfer(prefill, decode)
    decode.k_buffer[0][DECODE_SLOTS[N // 2]].view(torch.uint8).reshape(-1)[0] ^= 1
    reason = digest.refusal_at_commit(_req(), _scheduler(decode, DECODE_SLOTS), SimpleNamespace(), None)
    assert reason is not None and "KV digest mismatch" in reason


def test_no_digest_in_time_is_refused_and_a_prefill_without_the_patch_is_skipped(
        digest: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    decode = _scheduler(_pool(), DECODE_SLOTS)
    late = digest.Fetched({}, "prefill published no digest for room 4242 within 5 s", timed_out=True)
    monkeypatch.setattr(digest, "fetch_digests", lambda *a: late)
    reason = digest.refusal_at_commit(_req(), decode, SimpleNamespace(), None)
    assert reason is not None and "could not be verified" in reason
    unpatched = digest.Fetched({}, "prefill's bootstrap server has no digest route (prefill not hardened)")
    monkeypatch.setattr(digest, "fetch_digests", lambda *a: unpatched)
    assert digest.refusal_at_commit(_req(), decode, SimpleNamespace(), None) is None


def test_log_mode_decodes_anyway_and_off_publishes_nothing(trees: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = _pool(seed=5), _pool()
    logged = load(trees["0.5.23"], monkeypatch, "log")
    _published(logged, prefill, monkeypatch)
    assert logged.refusal_at_commit(_req(), _scheduler(decode, DECODE_SLOTS), SimpleNamespace(), None) is None
    off = load(trees["0.5.23"], monkeypatch, "off")
    assert _published(off, prefill, monkeypatch).posted == {}
    with pytest.raises(ValueError, match="SGLANG_HARDEN_CHECKSUM"):
        load(trees["0.5.23"], monkeypatch, "sometimes")


def test_the_patched_shard_is_the_plugins(digest: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same rows, same wire values: a plugin decode verifies a patched prefill's post, and the reverse."""
    prefill = _pool(seed=7)
    posted = _published(digest, prefill, monkeypatch).posted
    layout = pool_layout(_scheduler(prefill, PREFILL_SLOTS))[0]
    slots = torch.tensor(PREFILL_SLOTS, dtype=torch.long)
    plugin = shard_digest(prefill.k_buffer, prefill.v_buffer, slots, layout, start_token=0, rank=0, backend="torch")
    assert posted == {0: tuple(checksum.pack_shard(plugin))}


def test_doctor_sees_the_backported_digest(trees: dict[str, Path], tmp_path: Path) -> None:
    """Patched, decode's commit gate verifies the digest, on by default; pristine 0.5.19 has none and pristine 0.5.23
    only its own (``_verify_kv_checksums``, opt-in on a full tree)."""
    for pin, tree in trees.items():
        patched = detect_kv_checksum(SourceTree(tree))
        assert patched.status == "yes" and "commit gate" in patched.evidence[0], (pin, patched)
        pristine = detect_kv_checksum(SourceTree(make_tree(pin, tmp_path / pin)))
        assert not any("_commit_transfer_to_req" in e for e in pristine.evidence), (pin, pristine)


TRITON_CHILD = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("pd_digest_triton", {module!r})
triton_module = importlib.util.module_from_spec(spec)
sys.modules["pd_digest_triton"] = triton_module  # Triton's JIT looks its kernels' module up
spec.loader.exec_module(triton_module)
layout = triton_module.KVLayout(dtype="bfloat16", head_dim=16, itemsize=2, num_layers=3, kv_halves=2,
                                total_kv_heads=2, head_start=0, num_heads=2, page_size=1)
gen = torch.Generator().manual_seed(4)
k = [torch.randn((64, 2, 16), generator=gen).to(torch.bfloat16) for _ in range(3)]
v = [torch.randn((64, 2, 16), generator=gen).to(torch.bfloat16) for _ in range(3)]
slots = torch.arange(3, 23, dtype=torch.int64)
triton_sums = triton_module.sums_triton(k, v, slots, layout, 5)
torch_sums = triton_module.sums_torch(k, v, slots, layout, 5)
assert triton_sums.tolist() == torch_sums.tolist(), (triton_sums, torch_sums)
print("TRITON_SUMS_OK")
"""


def test_the_series_triton_kernel_sums_as_its_torch_path(trees: dict[str, Path]) -> None:
    """The series' ``pd_digest_triton`` (used on CUDA where the tree has Triton) gives the torch path's per-head
    sums, bit for bit (on this CPU host through TRITON_INTERPRET=1, in a child: the flag is read at import)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    module = trees["0.5.23"] / "sglang/srt/disaggregation/common/pd_digest_triton.py"
    done = subprocess.run([sys.executable, "-c", TRITON_CHILD.format(module=str(module))],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "TRITON_SUMS_OK" in done.stdout, done.stdout + done.stderr
