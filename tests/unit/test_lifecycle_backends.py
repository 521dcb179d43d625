"""Which transfer backends the page lifecycle runs on, and what a scheduler on another backend is told."""

from __future__ import annotations

import pytest

from sglang_harden.compat import lifecycle_v05
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import HardenConfig, Mode


def _hook(module: str) -> object:
    return next(h for h in lifecycle_v05.HOOKS if h.module == module)


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_each_backend_needs_only_its_own_module_hooks(backend: str) -> None:
    own, other = lifecycle_v05.BACKEND_MODULES[backend], {"mooncake": lifecycle_v05.NIXL,
                                                          "nixl": lifecycle_v05.MOONCAKE}[backend]
    assert lifecycle_v05.needed_on_backend(_hook(own), backend)
    assert not lifecycle_v05.needed_on_backend(_hook(other), backend)
    assert lifecycle_v05.needed_on_backend(_hook(lifecycle_v05.CONN), backend)


@pytest.fixture()
def lifecycle_mode(request: pytest.FixtureRequest) -> object:
    saved = RUNTIME.config
    RUNTIME.config = HardenConfig(lifecycle=request.param)
    yield request.param
    RUNTIME.config = saved


@pytest.mark.parametrize("lifecycle_mode", [Mode.ENFORCE, Mode.LOG], indirect=True)
def test_other_backends_refused_with_the_way_out(lifecycle_mode: Mode) -> None:
    why = lifecycle_v05.check_backend("decode", "mori")
    assert why is not None and "'mori'" in why and "--harden-lifecycle off" in why
    assert lifecycle_v05.check_backend("prefill", "nixl") is None
    assert lifecycle_v05.check_backend("null", "mori") is None  # no PD: nothing to guard


@pytest.mark.parametrize("lifecycle_mode", [Mode.OFF], indirect=True)
def test_lifecycle_off_runs_anywhere(lifecycle_mode: Mode) -> None:
    assert lifecycle_v05.check_backend("decode", "mori") is None
