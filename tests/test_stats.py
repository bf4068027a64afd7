"""umrt.memory_stats(): its keys, and the runtime's status (acting / stopped_reason)."""
from __future__ import annotations

import pytest

import umrt
from umrt import stats


@pytest.fixture(autouse=True)
def clean():
    stats.attach()
    yield
    stats.attach()


class Backend:
    h2d_bytes, d2h_bytes, discarded_bytes = 3 << 20, 1 << 20, 2 << 20

    def resident_bytes(self):
        return 5 << 20

    def counters(self):
        return {}


class Pool:
    def reserved_bytes(self):
        return 8 << 20


def test_memory_stats_keys_and_types():
    stats.attach(pool=Pool(), backend=Backend())
    got = umrt.memory_stats()
    process = ("allocated_bytes", "peak_allocated_bytes", "allocation_count")  # other tests' blocks count too
    assert all(isinstance(got.pop(k), int) for k in process)
    assert got == {"reserved_bytes": 8 << 20, "resident_bytes": 5 << 20, "migrated_bytes": 4 << 20,
                   "h2d_bytes": 3 << 20, "d2h_bytes": 1 << 20, "discarded_bytes": 2 << 20,
                   "populated_bytes": 0, "swapped_out_bytes": 0, "swapped_in_bytes": 0, "staging_bytes": 0,
                   "swap_copy": "", "cuda_calls": {}, "acting": False, "stopped_reason": None,
                   "native_steady": {}, "phases": {}}


def test_memory_stats_reports_the_native_steady_state(fake_gpu):
    from fake_cuda import FakeBindingsRuntime

    from umrt.allocators.managed import ManagedPool
    from umrt.backends.cuda import BindingsApi, CudaBackend
    from umrt.native.server import BackendCalls, SteadyServer

    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(fake_gpu)))
    pool = ManagedPool(backend)
    stats.attach(pool=pool, backend=backend, steady=SteadyServer(pool, calls=BackendCalls(backend), enabled=True))
    got = umrt.memory_stats()["native_steady"]
    assert got["phase"] == "following" and got["native_front"] is False and got["arms"] == 0


def test_memory_stats_counts_the_cuda_calls_umrt_issued(fake_gpu):
    """What the CUDA backend issued, by call name, and the bytes it populated."""
    from fake_cuda import FakeBindingsRuntime

    from umrt.backends.cuda import BindingsApi, CudaBackend

    backend = CudaBackend(0, api=BindingsApi(FakeBindingsRuntime(fake_gpu)))
    stats.attach(pool=Pool(), backend=backend)
    ptr = backend.malloc(4 << 20)
    backend.discard([(ptr, 4 << 20)])
    backend.populate([(ptr, 4 << 20)])  # discarded pages back without a copy
    backend.prefetch([(ptr, 1 << 20)], -1)
    got = umrt.memory_stats()
    assert got["populated_bytes"] == 4 << 20 and got["d2h_bytes"] == 1 << 20 and got["h2d_bytes"] == 0
    assert got["cuda_calls"]["cudaMemPrefetchAsync"] == 2 and got["cuda_calls"]["cudaMemDiscardBatchAsync"] == 1


def test_runtime_status_transitions():
    stats.runtime_started()
    assert stats.runtime_status() == stats.RuntimeStatus(acting=True, stopped_reason=None)
    stats.runtime_stopped("CudaError: boom")
    assert (umrt.memory_stats()["acting"], umrt.memory_stats()["stopped_reason"]) == (False, "CudaError: boom")
    stats.runtime_closed()  # disable() after a failure: the reason stays readable
    assert umrt.memory_stats()["stopped_reason"] == "CudaError: boom"
    stats.runtime_started()  # a new runtime starts clean
    assert umrt.memory_stats()["stopped_reason"] is None and umrt.memory_stats()["acting"]
    stats.runtime_closed()
    assert umrt.memory_stats()["acting"] is False


def test_a_new_session_forgets_an_earlier_failure():
    stats.runtime_stopped("RuntimeError: old")
    stats.attach(pool=Pool(), backend=Backend())
    assert stats.runtime_status() == stats.RuntimeStatus()


def test_runtime_status_is_a_copy():
    stats.runtime_started()
    copy = stats.runtime_status()
    copy.acting = False
    assert stats.runtime_status().acting
