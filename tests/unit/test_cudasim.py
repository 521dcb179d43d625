"""The testbed's CUDA simulator (sglang_harden/testbed/cudasim*.py): device marks, counted host syncs and their
owners, pinned memory, asynchronous device->host copies that hold poison until the host waits for their stream,
streams and events (also across threads). Runs under a pin venv's python (needs torch)."""

from __future__ import annotations

import math
import textwrap
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from sglang_harden.testbed import cudasim  # noqa: E402
from sglang_harden.testbed.cudasim_mode import NUMPY_ERROR  # noqa: E402

HARDEN_FILE = "/opt/x/sglang_harden/compat/fake_hook.py"
PATCHED_FILE = "/venv/site-packages/sglang/srt/disaggregation/pd_fake.py"
SGLANG_FILE = "/venv/site-packages/sglang/srt/managers/fake_scheduler.py"


def run_as(path: str, source: str, **names: Any) -> dict[str, Any]:
    """Run ``source`` as if it were the file ``path`` (attribution reads the frame's file name)."""
    namespace: dict[str, Any] = {"torch": torch, **names}
    exec(compile(textwrap.dedent(source), path, "exec"), namespace)
    return namespace


def syncs() -> dict[tuple[str, str], int]:
    """(owner, kind) -> n."""
    out: dict[tuple[str, str], int] = {}
    for (owner, kind, _site), n in cudasim.counts()["syncs"].items():
        out[(owner, kind)] = out.get((owner, kind), 0) + n
    return out


def poisoned() -> dict[str, int]:
    return cudasim.report()["poisoned_reads"]


def in_flight(dev: Any, values: list[int] | None = None, dtype: Any = None) -> tuple[Any, Any]:
    """A device tensor and a pinned host tensor it is being copied into (non_blocking), not yet waited for."""
    src = torch.tensor(values or [3, 5, 7], dtype=dtype or torch.int32, device=dev)
    dst = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
    dst.copy_(src, non_blocking=True)
    return src, dst


def test_device_marks_follow_the_simulated_device() -> None:
    with cudasim.session() as dev:
        a = torch.arange(8, device=dev)
        host = torch.arange(8, device="cpu")
        assert cudasim.is_device(a) and not cudasim.is_device(host)
        assert a.device == "cpu" and a.device.type == "cpu" and a.device is dev
        assert not a.is_cuda and not torch.cuda.is_available()
        assert cudasim.is_device(a + host) and cudasim.is_device(a[2:5]) and cudasim.is_device(torch.zeros_like(a))
        assert cudasim.is_device(torch.empty(3, device=a.device))
        assert all(cudasim.is_device(x) for x in a.split(3)) and all(cudasim.is_device(x) for x in a)
        assert cudasim.is_device(torch.cat([host, a]))
        assert not cudasim.is_device(torch.empty_like(a, device="cpu"))
        assert cudasim.is_device(cudasim.mark_device(torch.ones(1)))


def test_reading_a_device_tensor_is_a_counted_sync_and_host_reads_are_not() -> None:
    with cudasim.session() as dev:
        a = torch.arange(8, device=dev)
        host = torch.arange(8)
        a[1].item(), a.tolist(), int(a[2]), bool(a[3]), host.tolist(), host[0].item()
        assert syncs() == {("other", "item"): 1, ("other", "tolist"): 1, ("other", "scalar"): 2}


def test_numpy_of_a_device_tensor_raises_like_cuda_and_is_counted() -> None:
    import numpy as np

    with cudasim.session() as dev:
        a = torch.arange(4, device=dev)
        with pytest.raises(TypeError, match="simulated device"):
            a.numpy()
        with pytest.raises(TypeError) as info:
            np.asarray(a)
        assert str(info.value) == NUMPY_ERROR
        assert a.cpu().numpy().tolist() == [0, 1, 2, 3]
        assert syncs() == {("other", "numpy"): 2, ("other", "d2h"): 1}


def test_cpu_and_to_cpu_return_real_host_copies() -> None:
    with cudasim.session() as dev:
        a = torch.arange(4, device=dev)
        for host in (a.cpu(), a.to("cpu"), a.to(torch.device("cpu")), a.to(torch.zeros(1))):
            assert host is not a and not cudasim.is_device(host)
            host[0] = 99
            assert int(a[0]) == 0
        back = torch.arange(4).to(dev)
        assert cudasim.is_device(back)
        assert syncs() == {("other", "d2h"): 4, ("other", "scalar"): 4, ("other", "h2d"): 1}


def test_blocking_host_to_device_copies_are_counted() -> None:
    with cudasim.session() as dev:
        torch.tensor([1, 2], device=dev)
        torch.as_tensor(torch.ones(2), device=dev)
        torch.zeros(2).to(dev, non_blocking=True)  # stream-ordered: not a host wait
        torch.empty(2, device=dev).copy_(torch.ones(2))
        torch.empty(2, device=dev).copy_(torch.ones(2), non_blocking=True)
        torch.empty(2, device=dev).copy_(torch.ones(2, device=dev))
        assert syncs() == {("other", "h2d"): 3}


def test_data_dependent_shapes_and_comparisons_are_counted() -> None:
    with cudasim.session() as dev:
        a = torch.tensor([0, 2, 0, 4], device=dev)
        torch.nonzero(a), a.nonzero(), a[a > 0], torch.where(a > 0), torch.unique(a), a.unique_consecutive()
        torch.masked_select(a, a > 0), torch.argwhere(a), torch.repeat_interleave(a, a)
        torch.where(a > 0, a, a)  # three arguments: fixed shape
        a[torch.tensor([0, 1], device=dev)]  # integer index: fixed shape
        torch.equal(a, a), torch.allclose(a.float(), a.float())
        b = a.clone()
        b[b > 0] = 1
        assert syncs() == {("other", "dynamic_shape"): 10, ("other", "compare"): 2, ("other", "h2d"): 2}


def test_pinned_memory_works_on_cpu_torch() -> None:
    with cudasim.session():
        pinned = torch.empty(4, pin_memory=True)
        assert pinned.is_pinned() and pinned[1:].is_pinned()
        assert torch.zeros(2, pin_memory=True).is_pinned()
        plain = torch.ones(3)
        assert not plain.is_pinned()
        copy = plain.pin_memory()
        assert copy.is_pinned() and copy is not plain and copy.tolist() == [1.0, 1.0, 1.0]
        assert copy.pin_memory() is copy


def test_async_copy_holds_poison_until_its_event_is_synchronised() -> None:
    with cudasim.session() as dev:
        _src, dst = in_flight(dev)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        assert dst.tolist() == [0, 0, 0]  # page 0: the dummy page, like stale pinned memory
        assert poisoned() == {"other": 1}
        event.synchronize()
        assert dst.tolist() == [3, 5, 7]
        assert poisoned() == {"other": 1}
        assert syncs() == {("other", "event_sync"): 1, ("other", "h2d"): 1}


def test_float_copies_are_poisoned_with_nan_and_the_value_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    with cudasim.session() as dev:
        _src, dst = in_flight(dev, dtype=torch.float32)
        assert all(math.isnan(x) for x in dst.tolist())
        monkeypatch.setenv(cudasim.POISON_ENV, "-1")
        _src, dst = in_flight(dev)
        assert dst.tolist() == [-1, -1, -1]


def test_a_copy_recorded_before_an_event_lands_with_it_and_a_later_one_does_not() -> None:
    with cudasim.session() as dev:
        _a, first = in_flight(dev, [1, 2])
        event = torch.cuda.current_stream().record_event()
        _b, second = in_flight(dev, [3, 4])
        assert event.query() is True  # lands what the event covers; not a counted sync
        assert first.tolist() == [1, 2] and second.tolist() == [0, 0]
        assert ("other", "event_sync") not in syncs()


def test_stream_device_and_blocking_syncs_land_copies() -> None:
    with cudasim.session() as dev:
        _s, dst = in_flight(dev)
        torch.cuda.current_stream().synchronize()
        assert dst.tolist() == [3, 5, 7]
        _s, dst = in_flight(dev)
        torch.cuda.synchronize()
        assert dst.tolist() == [3, 5, 7]
        src, dst = in_flight(dev)
        src[0].item()  # the host waits for the current stream
        assert dst.tolist() == [3, 5, 7]
        assert poisoned() == {}


def test_copies_belong_to_the_stream_they_were_issued_on() -> None:
    with cudasim.session() as dev:
        side = torch.cuda.Stream(priority=-1)
        with torch.cuda.stream(side):
            assert torch.cuda.current_stream() is side
            _s, dst = in_flight(dev)
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
        torch.cuda.current_stream().synchronize()
        assert dst.tolist() == [0, 0, 0]
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.current_stream().synchronize()  # the default stream waited for side: side's copy is done
        assert dst.tolist() == [3, 5, 7]
        with torch.cuda.stream(side):
            _s, dst = in_flight(dev)
            event = torch.cuda.Event()
            event.record()
        event.wait(torch.cuda.current_stream())
        assert side.query() and dst.tolist() == [3, 5, 7]


def test_to_cpu_non_blocking_gives_a_pinned_poisoned_tensor() -> None:
    with cudasim.session() as dev:
        a = torch.arange(1, 4, device=dev)
        host = a.to("cpu", non_blocking=True)
        assert host.is_pinned() and not cudasim.is_device(host)
        assert host.tolist() == [0, 0, 0]
        torch.cuda.current_stream().synchronize()
        assert host.tolist() == [1, 2, 3]


def test_views_of_a_copy_in_flight_are_poisoned_and_other_bytes_are_not() -> None:
    with cudasim.session() as dev:
        buffer = torch.full((8,), 9, dtype=torch.int32, pin_memory=True)
        buffer[:3].copy_(torch.tensor([1, 2, 3], dtype=torch.int32, device=dev), non_blocking=True)
        assert buffer[5:].tolist() == [9, 9, 9] and poisoned() == {}
        assert len(buffer[:3]) == 3 and buffer[1:2].shape == (1,) and poisoned() == {}
        assert int(buffer[1]) == 0 and poisoned() == {"other": 1}


def test_owners_of_syncs_and_poisoned_reads() -> None:
    source = """
        def hook(t, pinned):
            seen = pinned.tolist()
            t.tolist()
            torch.cuda.synchronize()
            return seen
        """
    with cudasim.session() as dev:
        for path in (HARDEN_FILE, PATCHED_FILE, SGLANG_FILE, "/work/x/sglang_harden/testbed/shim.py"):
            src, dst = in_flight(dev)
            run_as(path, source)["hook"](src, dst)
        report = cudasim.report()
        assert report["syncs"]["sglang_harden"] == {"tolist": 2, "device_sync": 2}
        assert report["syncs"]["sglang"] == {"tolist": 1, "device_sync": 1}
        assert report["poisoned_reads"] == {"sglang_harden": 2, "sglang": 1, "other": 1}
        sites = {(owner, kind, site) for owner, kind, site, _n in report["sites"]}
        assert ("sglang_harden", "tolist", "sglang_harden/compat/fake_hook.py:4:hook") in sites
        assert ("sglang_harden", "device_sync", "sglang/srt/disaggregation/pd_fake.py:5:hook") in sites
        assert ("sglang", "tolist", "sglang/srt/managers/fake_scheduler.py:4:hook") in sites
        assert ["sglang_harden", "tolist", "sglang_harden/compat/fake_hook.py:3:hook", 1] in report["poisoned_sites"]


def test_owner_of_paths() -> None:
    assert cudasim.owner_of("/site-packages/sglang_harden/compat/lifecycle_v05.py") == "sglang_harden"
    assert cudasim.owner_of("/work/wt/sglang_harden/testbed/shims/x.py") == "other"
    assert cudasim.owner_of("/site-packages/sglang/srt/disaggregation/pd_auth.py") == "sglang_harden"
    assert cudasim.owner_of("/site-packages/sglang/srt/managers/scheduler.py") == "sglang"
    assert cudasim.owner_of("/site-packages/triton/runtime/interpreter.py") is None
    assert cudasim.owner_of("/usr/lib/python3.11/threading.py") == "other"


def test_worker_thread_waits_on_the_event_the_scheduler_thread_recorded() -> None:
    results: list[list[int]] = []
    with cudasim.session() as dev:
        work: list[tuple[Any, Any]] = []
        for i in range(200):
            _src, dst = in_flight(dev, [i, i + 1])
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            work.append((dst, event))

        def worker() -> None:
            for dst, event in work:
                event.synchronize()  # unmoded thread: not counted
                results.append(dst.numpy().tolist())

        threads = [threading.Thread(target=worker) for _ in range(2)]
        for thread in threads:
            thread.start()
        for _ in range(200):  # the moded thread keeps issuing copies meanwhile
            in_flight(dev)
        for thread in threads:
            thread.join()
        assert len(results) == 400 and all(r == [r[0], r[0] + 1] for r in results)
        assert poisoned() == {} and ("other", "event_sync") not in syncs()


def test_a_read_before_the_wait_on_an_unmoded_thread_is_seen() -> None:
    with cudasim.session() as dev:
        _src, dst = in_flight(dev)
        seen: list[list[int]] = []
        thread = threading.Thread(target=lambda: seen.append(dst.numpy().tolist()))
        thread.start()
        thread.join()
        assert seen == [[0, 0, 0]] and poisoned() == {"other": 1}


def test_thread_waits_of_sglang_harden_on_the_moded_thread_are_counted() -> None:
    source = """
        import queue, threading
        def wait():
            threading.Event().wait(0.001)
            q = queue.Queue()
            q.put(1)
            q.get()
            q.put(1)
            q.get(block=False)
        """
    with cudasim.session():
        run_as(HARDEN_FILE, source)["wait"]()
        run_as(SGLANG_FILE, source)["wait"]()
        other = threading.Thread(target=run_as(HARDEN_FILE, source)["wait"])
        other.start()
        other.join()
        assert syncs() == {("sglang_harden", "thread_wait"): 2}


def test_report_shape_and_session_restores_torch_cuda() -> None:
    before = torch.cuda.Event
    with cudasim.session() as dev:
        assert torch.cuda.Event is cudasim.SimEvent and torch.cuda.Stream is cudasim.SimStream
        torch.arange(3, device=dev).tolist()
        cudasim.note_pass()
        report = cudasim.report()
        assert set(report) == {"syncs", "sites", "poisoned_reads", "poisoned_sites", "async_copies", "landed",
                               "marked_tensors_seen", "passes", "pending_copies"}
        assert report["passes"] == 1 and report["marked_tensors_seen"] >= 1
        assert report["sites"][0][:2] == ["other", "tolist"]
        in_flight(dev)
        empty = torch.empty(0, dtype=torch.int32, pin_memory=True)
        empty.copy_(torch.empty(0, dtype=torch.int32, device=dev), non_blocking=True)
        copies = {site.rsplit(":", 1)[-1]: n for _owner, site, n in cudasim.report()["async_copies"]}
        assert copies == {"in_flight": 1, "test_report_shape_and_session_restores_torch_cuda [empty]": 1}
    assert torch.cuda.Event is before
    assert not torch.cuda.is_available()


def test_the_device_module_of_the_simulated_device_has_the_simulated_streams() -> None:
    """SGLang reaches streams through ``torch.get_device_module(device)`` (torch.cpu here): 0.5.19's overlap copy
    of the sampled tokens (``to("cpu", non_blocking=True)``, then a ``copy_done`` event it waits on) must land."""
    with cudasim.session() as dev:
        module = torch.get_device_module(dev)
        assert module.Event is cudasim.SimEvent and module.Stream is cudasim.SimStream
        tokens = torch.tensor([11, 12], device=dev).to("cpu", non_blocking=True)
        copy_done = module.Event()
        copy_done.record()
        with module.stream(module.Stream(priority=0)):
            assert module.current_stream() is not torch.cuda.default_stream()
        copy_done.synchronize()
        assert tokens.tolist() == [11, 12] and poisoned() == {}
    assert torch.cpu.Event is not cudasim.SimEvent


def test_a_stream_context_can_be_entered_again() -> None:
    with cudasim.session():
        side = torch.cuda.Stream()
        context = torch.cuda.stream(side)  # SGLang keeps one and enters it for every batch
        for _ in range(2):
            with context:
                assert torch.cuda.current_stream() is side
            assert torch.cuda.current_stream() is torch.cuda.default_stream()
        with torch.cuda.stream(None):
            assert torch.cuda.current_stream() is torch.cuda.default_stream()


def test_is_cuda_answers_true_only_to_the_owners_named(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = "def probe(t):\n    return t.is_cuda\n"
    monkeypatch.setenv("SGLANG_HARDEN_TESTBED_CUDASIM_CUDA_FOR", "sglang_harden")
    with cudasim.session() as dev:
        a = torch.zeros(1, device=dev)
        assert run_as(HARDEN_FILE, probe)["probe"](a) is True
        assert run_as(SGLANG_FILE, probe)["probe"](a) is False
        assert run_as(HARDEN_FILE, probe)["probe"](torch.zeros(1)) is False
    monkeypatch.delenv("SGLANG_HARDEN_TESTBED_CUDASIM_CUDA_FOR")
    with cudasim.session() as dev:
        assert run_as(HARDEN_FILE, probe)["probe"](torch.zeros(1, device=dev)) is False
