"""Digest on a CUDA device: Triton and torch-on-CUDA match the numpy reference bit for bit.

Skipped without torch or without a CUDA device (``scripts/gpu_check.sh`` runs it on a GPU machine).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch not installed: run with a pin venv's python")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="triton not installed")

from sglang_harden.kernels.digest import compute_digests  # noqa: E402
from sglang_harden.kernels.digest_ref import digest_numpy  # noqa: E402
from sglang_harden.kernels.digest_spec import KVLayout, token_slots  # noqa: E402
from sglang_harden.kernels.digest_torch import digest_torch  # noqa: E402
from sglang_harden.kernels.digest_triton import TritonDigester  # noqa: E402

CASES = [
    # name, storage dtype, head_dim, halves, heads, page, layers, tokens
    ("bfloat16", torch.bfloat16, 128, 2, 8, 16, 4, 1000),
    ("float16", torch.float16, 64, 2, 4, 1, 3, 777),
    ("float8_e4m3fn", torch.uint8, 128, 2, 2, 64, 2, 4097),
    ("mla_bf16", torch.bfloat16, 576, 1, 1, 32, 3, 513),
]


def pool(case: tuple, device: str) -> tuple[KVLayout, list, list | None, list[int]]:
    name, storage, dim, halves, heads, page, layers, tokens = case
    itemsize = torch.empty(0, dtype=storage).element_size()
    layout = KVLayout(name, dim, itemsize, layers, halves, heads * 2, heads, heads, page)
    slots_total = 2 * tokens + 2 * page
    gen = torch.Generator().manual_seed(tokens)

    def one() -> torch.Tensor:
        raw = torch.randint(0, 256, (slots_total, heads, layout.row_bytes), dtype=torch.uint8, generator=gen)
        return raw.view(storage).to(device)

    k = [one() for _ in range(layers)]
    v = [one() for _ in range(layers)] if halves == 2 else None
    pages = torch.randperm(slots_total // page, generator=gen).tolist()
    return layout, k, v, token_slots(pages, page, tokens)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_paths_match_numpy(case: tuple) -> None:
    layout, k, v, slots = pool(case, "cuda")
    k_np = [b.view(torch.uint8).cpu().numpy() for b in k]
    v_np = None if v is None else [b.view(torch.uint8).cpu().numpy() for b in v]
    want = digest_numpy(k_np, v_np, slots, layout, start_token=123)
    assert TritonDigester(k, v, layout).digest(slots, start_token=123) == want
    assert digest_torch(k, v, slots, layout, start_token=123) == want
    assert compute_digests(k, v, slots, layout, start_token=123) == want  # auto picks Triton on CUDA


def test_triton_block_sizes_agree_and_empty_request() -> None:
    layout, k, v, slots = pool(CASES[0], "cuda")
    base = TritonDigester(k, v, layout, block_t=32).digest(slots)
    for block in (1, 16, 64, 128):
        assert TritonDigester(k, v, layout, block_t=block).digest(slots) == base
    assert TritonDigester(k, v, layout).digest([]) == digest_torch(k, v, [], layout)


def test_large_request_triton_equals_torch() -> None:
    case = ("bfloat16", torch.bfloat16, 128, 2, 8, 64, 32, 8192)
    layout, k, v, slots = pool(case, "cuda")
    idx = torch.tensor(slots, device="cuda")
    assert TritonDigester(k, v, layout).digest(idx) == digest_torch(k, v, idx, layout)
