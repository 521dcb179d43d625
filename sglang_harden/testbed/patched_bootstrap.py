"""A patched tree's bootstrap server, on its own, for tests: SGLang's real ``CommonKVBootstrapServer`` running the
code of a backport series (``patches/<pin>``), with the plugin off.

    SGLANG_HARDEN_ACTIVATE=0 <pin venv python> -m sglang_harden.testbed.patched_bootstrap TREE PORT

``TREE`` holds only the files the series touches (patched); every other SGLang module comes from the venv. An
import finder serves exactly those files from ``TREE`` (test-only: an operator patches a whole site-packages).
Once serving, it registers a prefill rank through SGLang's own bootstrap client (``common/conn.py``'s
``requests``) and posts a rejection through ``pd_rejections``' client, prints one JSON line with the outcome and
serves until killed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REJECTED_ROOM = 31_337


def registration(port: int) -> dict[str, Any]:
    """The body a single-rank prefill sends to ``PUT /route`` at start-up."""
    return {"role": "Prefill", "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
            "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": port, "page_size": 1,
            "kv_cache_dtype": "auto", "load_balance_method": "round_robin"}


class PatchedFiles(importlib.abc.MetaPathFinder):
    """Serve the modules whose files are in ``tree`` from there (packages' ``__init__`` stay the venv's)."""

    def __init__(self, tree: Path) -> None:
        self.tree = tree

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        candidate = self.tree / (fullname.replace(".", "/") + ".py")
        return importlib.util.spec_from_file_location(fullname, candidate) if candidate.is_file() else None


def wait_healthy(base: str, timeout_s: float = 30.0) -> None:
    """Until a bootstrap server at ``base`` answers ``/health``; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the bootstrap server at {base} never answered /health")


def main(tree: Path, port: int) -> None:
    sys.meta_path.insert(0, PatchedFiles(tree))
    from sglang.srt.disaggregation.common import conn, pd_auth, pd_rejections

    assert Path(conn.__file__).is_relative_to(tree), conn.__file__
    conn.CommonKVBootstrapServer("127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    registered = conn.requests.put(base + "/route", json=registration(17000), timeout=10)
    notice = json.dumps({"room": REJECTED_ROOM, "status_code": 400, "message": "too long"}).encode()
    posted = pd_rejections._put(base + pd_rejections.ROUTE, notice)
    print(json.dumps({"ready": True, "conn_file": conn.__file__, "authenticated": pd_auth.AUTH is not None,
                      "client_register_status": registered.status_code, "rejection_posted": posted}), flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), int(sys.argv[2]))
