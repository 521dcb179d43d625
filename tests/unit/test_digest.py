"""torch CPU, native C and Triton digest paths match the numpy reference bit for bit.

Needs torch: run with a pin venv's python, e.g.
``~/.cache/sglang-harden/venvs/0.5.23/bin/python -m pytest tests/unit/test_digest.py``.
Under the system python (no torch) the module is skipped with that reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed: run with a pin venv's python")

from sglang_harden.kernels.digest import compute_digests, pick_backend, shard_digest  # noqa: E402
from sglang_harden.kernels.digest_native import digest_native, native_status  # noqa: E402
from sglang_harden.kernels.digest_ref import digest_numpy  # noqa: E402
from sglang_harden.kernels.digest_spec import KVLayout, token_slots  # noqa: E402
from sglang_harden.kernels.digest_torch import digest_torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CASES = [
    # dtype name, torch storage dtype, head_dim, halves, heads, page size
    ("bfloat16", torch.bfloat16, 128, 2, 2, 16),
    ("float16", torch.float16, 64, 2, 3, 1),
    ("float8_e4m3fn", torch.uint8, 128, 2, 2, 4),
    ("float32", torch.float32, 8, 2, 1, 2),
    ("mla_bf16", torch.bfloat16, 576, 1, 1, 8),
]


def random_pool(storage: torch.dtype, layout: KVLayout, slots: int, seed: int) -> tuple[list, list | None]:
    gen = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        raw = torch.randint(0, 256, (slots, layout.num_heads, layout.row_bytes), dtype=torch.uint8, generator=gen)
        return raw.view(storage)

    k = [one() for _ in range(layout.num_layers)]
    v = [one() for _ in range(layout.num_layers)] if layout.kv_halves == 2 else None
    return k, v


def as_numpy(bufs: list | None) -> list | None:
    return None if bufs is None else [b.view(torch.uint8).numpy() for b in bufs]


def case_layout(dtype: str, storage: torch.dtype, head_dim: int, halves: int, heads: int, page: int) -> KVLayout:
    itemsize = torch.empty(0, dtype=storage).element_size()
    return KVLayout(dtype, head_dim, itemsize, 3, halves, heads * 2, heads, heads, page)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_torch_matches_numpy(case: tuple, seed: int) -> None:
    layout = case_layout(*case)
    k, v = random_pool(case[1], layout, 96, seed)
    rng = np.random.default_rng(seed)
    n_tokens = int(rng.integers(1, 70))
    pages = [int(p) for p in rng.permutation(96 // layout.page_size)]
    slots = token_slots(pages, layout.page_size, n_tokens)
    want = digest_numpy(as_numpy(k), as_numpy(v), slots, layout, start_token=5)
    # a tiny chunk forces many chunk boundaries, the default one a single chunk
    assert digest_torch(k, v, slots, layout, start_token=5, chunk_bytes=1000) == want
    assert digest_torch(k, v, torch.tensor(slots), layout, start_token=5) == want


def test_native_is_built_here() -> None:
    """CI installs a C compiler, so the native path must be live there, not silently replaced by torch."""
    built, why = native_status()
    assert built, why


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_native_matches_numpy(case: tuple, seed: int) -> None:
    layout = case_layout(*case)
    k, v = random_pool(case[1], layout, 96, seed)
    rng = np.random.default_rng(seed + 10)
    n_tokens = int(rng.integers(1, 70))
    pages = [int(p) for p in rng.permutation(96 // layout.page_size)]
    slots = token_slots(pages, layout.page_size, n_tokens)
    want = digest_numpy(as_numpy(k), as_numpy(v), slots, layout, start_token=7)
    for threads in (1, 2, 5):  # 5 > layer halves for MLA: some runs get one half, none get zero
        assert digest_native(k, v, slots, layout, start_token=7, threads=threads) == want


def test_native_reads_strided_head_views_and_refuses_bad_slots() -> None:
    """A pool whose rows are a view with a head stride wider than head_dim (e.g. a packed K|V buffer)."""
    layout = case_layout(*CASES[0])
    wide = torch.randint(0, 256, (40, layout.num_heads, 2 * layout.row_bytes), dtype=torch.uint8)
    k = [wide.view(torch.bfloat16)[:, :, : layout.head_dim] for _ in range(layout.num_layers)]
    v = [wide.view(torch.bfloat16)[:, :, layout.head_dim :] for _ in range(layout.num_layers)]
    slots = [5, 39, 0, 17]
    want = digest_numpy(as_numpy([b.contiguous() for b in k]), as_numpy([b.contiguous() for b in v]), slots, layout)
    assert digest_native(k, v, slots, layout) == want
    with pytest.raises(ValueError, match="outside the pool"):
        digest_native(k, v, [40], layout)
    with pytest.raises(ValueError, match="outside the pool"):
        digest_native(k, v, [-1], layout)


def test_native_off_switch_falls_back_to_torch(tmp_path: Path) -> None:
    script = (
        "from sglang_harden.kernels.digest_native import native_status\n"
        "from sglang_harden.kernels.digest import pick_backend\n"
        "import torch\n"
        "print(native_status(), pick_backend(torch.zeros(1)))\n"
    )
    env = {**os.environ, "SGLANG_HARDEN_NATIVE_DIGEST": "0", "SGLANG_HARDEN_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "disabled by SGLANG_HARDEN_NATIVE_DIGEST" in out.stdout and out.stdout.strip().endswith("torch")
    env = {**os.environ, "CC": "/nonexistent-cc", "PATH": str(tmp_path), "SGLANG_HARDEN_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no C compiler" in out.stdout and out.stdout.strip().endswith("torch")


def test_real_fp8_dtype_digests_its_bytes() -> None:
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        pytest.skip("this torch has no float8_e4m3fn")
    layout = KVLayout("float8_e4m3fn", 64, 1, 2, 2, 1, 0, 1, 1)
    k, v = random_pool(torch.uint8, layout, 8, 3)
    slots = [4, 1, 6]
    assert digest_torch([b.view(fp8) for b in k], [b.view(fp8) for b in v], slots, layout) == digest_torch(
        k, v, slots, layout
    )


def test_empty_request_and_dispatch() -> None:
    layout = case_layout(*CASES[0])
    k, v = random_pool(torch.bfloat16, layout, 32, 0)
    assert compute_digests(k, v, [], layout) == digest_numpy(as_numpy(k), as_numpy(v), [], layout)
    assert pick_backend(k[0]) == "native"
    assert compute_digests(k, v, [3, 4], layout, backend="torch") == compute_digests(k, v, [3, 4], layout)
    assert pick_backend(as_numpy(k)[0]) == "numpy"
    sd = shard_digest(k, v, [3, 4], layout, rank=1)
    assert sd.rank == 1 and sd.n_tokens == 2 and set(sd.by_head()) == set(layout.heads)


def test_layout_mismatch_is_refused() -> None:
    layout = case_layout(*CASES[0])
    k, v = random_pool(torch.bfloat16, layout, 8, 0)
    wrong = KVLayout(**{**layout.__dict__, "head_dim": 64})
    with pytest.raises(ValueError):
        digest_torch(k, v, [0], wrong)


TRITON_SCRIPT = """
import sys, torch
sys.path.insert(0, {repo!r})
from tests.unit.test_digest import CASES, case_layout, random_pool, as_numpy
from sglang_harden.kernels.digest_ref import digest_numpy
from sglang_harden.kernels.digest_spec import token_slots
from sglang_harden.kernels.digest_triton import TritonDigester
device = {device!r}
for case in CASES:
    layout = case_layout(*case)
    k, v = random_pool(case[1], layout, 48, 11)
    slots = token_slots(list(range(48 // layout.page_size))[::-1], layout.page_size, 37)
    want = digest_numpy(as_numpy(k), as_numpy(v), slots, layout, start_token=2)
    kd = [b.to(device) for b in k]
    vd = None if v is None else [b.to(device) for b in v]
    got = TritonDigester(kd, vd, layout).digest(slots, start_token=2)
    assert got == want, (case[0], got, want)
print("TRITON_OK", len(CASES))
"""


def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _triton_installed(), reason="triton not installed")
def test_triton_matches_numpy() -> None:
    """On a GPU directly; on CPU through TRITON_INTERPRET=1 in a child (the flag is read at import)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = dict(os.environ)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    script = TRITON_SCRIPT.format(repo=str(REPO), device=device)
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TRITON_OK" in proc.stdout


@pytest.mark.skipif(not _triton_installed(), reason="triton not installed")
def test_triton_kernel_compiles_for_hopper() -> None:
    """The real compiler (not the interpreter) accepts the kernel and emits 128-bit loads, on a CPU host too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from sglang_harden.kernels import digest_triton
    from sglang_harden.kernels.digest_spec import KEY_SALT, LAYER_HALF_SHIFT

    ptrs = ("table_ptr", "slots_ptr", "mult_ptr", "partial_ptr")
    ints = {"n_tokens": "i32", "start_token": "i32", "n_blocks": "i32", "stride_slot": "i64", "stride_head": "i32"}
    consts = {
        "HEADS": 8,
        "WORDS": 64,
        "BLOCK_T": 32,
        "BLOCK_W": 64,
        "KEY": KEY_SALT,
        "SHIFT": LAYER_HALF_SHIFT,
        "ALIGNED": True,
    }
    signature = {**{p: "*i64" for p in ptrs}, **ints, **{c: "constexpr" for c in consts}}
    src = ASTSource(fn=digest_triton._digest_kernel, signature=signature, constexprs=consts)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:  # e.g. no ptxas in this triton build
        pytest.skip(f"cannot compile for sm_90 here: {exc}")
    assert "ld.global.v4.b32" in kernel.asm["ptx"]
