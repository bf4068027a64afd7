"""Real-GPU checks of the native steady state's data safety (issue 19; marked ``gpu``,
skipped without a CUDA device). They are what a GPU run must show before the native
steady state (``UMRT_NATIVE=1``) becomes the default: README.md, "The native steady
state". The allocator swap is irreversible for a process: those run in a subprocess."""
from __future__ import annotations

import json
import math
import textwrap

import pytest
from test_gpu import _boot_with_hook

pytestmark = pytest.mark.gpu
MiB = 2**20

# A small MLP trained until umrt serves its steps natively (UMRT_NATIVE=1), under a budget
# small enough that the runtime evicts and discards.
PRELUDE = textwrap.dedent("""
    import json, sys, torch
    import umrt.stats

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 1024, device="cuda")

    def step():
        h = model[0](x)
        a = model[1](h)
        loss = model[2](a).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item(), a

    def report():
        return umrt.stats.memory_stats()["native_steady"]

    def until_native(limit=40):
        for _ in range(limit):
            step()
            if report().get("phase") == "native":
                return True
        return False
""")

ENV = {"UMRT": "1", "UMRT_POLICY": "umrt", "UMRT_GPU_MEMORY": "24MiB", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _run(tmp_path, body: str, native: str = "1") -> dict:
    (tmp_path / native).mkdir(exist_ok=True)
    out = _boot_with_hook(tmp_path / native, PRELUDE + textwrap.dedent(body), {**ENV, "UMRT_NATIVE": native})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])


def test_an_activation_kept_past_its_recorded_free_keeps_its_data(tmp_path):
    """Finding 1: an activation kept alive across the next steps' first allocations (freed
    later than in the recorded step) equals a host copy taken before."""
    got = _run(tmp_path, """
        assert until_native(), report()
        loss, kept = step()  # kept: an activation the recorded step freed during backward
        copy = kept.cpu()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print("RESULT", json.dumps({"same": bool(torch.equal(kept.cpu(), copy)), "native": report()}))
    """)
    assert got["same"], got
    assert got["native"]["arms"] >= 1


def test_empty_cache_while_native_then_a_step_trains_as_python_does(tmp_path):
    """Finding 2: torch.cuda.empty_cache() while the schedule serves, then steps: the same
    losses as the Python path (UMRT_NATIVE=0) doing the same, no illegal address."""
    body = """
        until_native()
        losses = [step()[0] for _ in range(2)]
        torch.cuda.empty_cache()
        losses += [step()[0] for _ in range(4)]
        print("RESULT", json.dumps({"losses": losses, "native": report()}))
    """
    native, python = _run(tmp_path, body, "1"), _run(tmp_path, body, "0")
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(native["losses"], python["losses"], strict=True))
    assert native["native"]["arms"] >= 1 and "empty_cache" in native["native"]["last_deviation"], native


def test_a_failed_native_call_leaves_the_next_kernel_launch_clean():
    """Finding 3: a decision that fails on torch's own libcudart (a prefetch to a device that
    does not exist), then x + 1: torch's launch check must not see umrt's error."""
    import torch

    from umrt.backends.cuda import CudaBackend
    from umrt.native.binding import NativeSteadySchedule, cudart_table, native_library
    from umrt.native.constants import DecisionKind, Deviation
    from umrt.native.recorder import AllocAt, CallAt
    from umrt.native.schedule import compile_schedule
    from umrt.native.tables import loaded_libcudart

    torch.ones(1, device="cuda")  # torch's libcudart loaded and its context made
    lib = native_library()
    path, why = loaded_libcudart()
    if lib is None or path is None:
        pytest.skip(f"no native schedule or no libcudart: {why}")
    backend = CudaBackend(0)
    try:
        ptr = backend.malloc(MiB)
        arrays = compile_schedule([AllocAt(MiB, ptr), CallAt(DecisionKind.POPULATE, ((ptr, MiB),), 99,
                                                                     exact=True)])
        schedule = NativeSteadySchedule(lib, arrays)
        schedule.set_c_table(cudart_table(path))
        schedule.arm(0, 0)
        assert schedule.malloc(MiB) == ptr and schedule.deviation()[0] == Deviation.CALL, schedule.deviation()
        x = torch.ones(4, device="cuda")
        y = x + 1  # raised "CUDA error: invalid device ordinal" before the fix
        torch.cuda.synchronize()
        assert y.sum().item() == 8.0
        schedule.disown()
    finally:
        backend.close()


def test_a_side_stream_tensor_recorded_on_the_main_stream_is_not_reused_under_its_reader(tmp_path):
    """Finding 4: a tensor made on a side stream, used on the main stream, record_stream'ed
    there, freed, and its size allocated again on the side stream (reusing its block): the
    main stream's consumer, held back by a long kernel, still reads the tensor's values."""
    got = _run(tmp_path, """
        until_native()
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        n, results = 1 << 22, []
        for _ in range(4):
            with torch.cuda.stream(side):
                t = torch.full((n,), 3.0, device="cuda")
            main.wait_stream(side)
            torch.cuda._sleep(50_000_000)  # the consumer runs late
            out = (t * 2).sum()
            t.record_stream(main)
            del t
            with torch.cuda.stream(side):
                u = torch.zeros(n, device="cuda")  # t's size again: its block, once the main stream is done
            results.append(out.item())
            del u
        print("RESULT", json.dumps({"results": results, "expected": 6.0 * n, "native": report()}))
    """)
    assert all(r == got["expected"] for r in got["results"]), got


def test_a_discard_of_one_64KiB_block_leaves_its_2MiB_region_neighbour_intact():
    """Whether the driver discards at 64 KiB or at 2 MiB granularity: two 64 KiB-aligned
    blocks in one 2 MiB region, the first discarded; the second keeps its bytes."""
    import ctypes

    import numpy as np

    from umrt.backends.cuda import CudaBackend

    backend = CudaBackend(0)
    try:
        if not backend.api.has_batch:
            pytest.skip("no cudaMemDiscardBatchAsync (CUDA 12): nothing is discarded")
        region = backend.malloc(2 * MiB)
        host = np.ctypeslib.as_array((ctypes.c_uint8 * (2 * MiB)).from_address(region))
        host[:] = np.arange(2 * MiB, dtype=np.uint64).astype(np.uint8)
        backend.prefetch([(region, 2 * MiB)], 0)
        backend.synchronize()
        block = 64 * 1024
        backend.discard([(region, block)])
        backend.synchronize()
        neighbour = host[block:2 * block]
        np.testing.assert_array_equal(neighbour, (np.arange(block, 2 * block, dtype=np.uint64)).astype(np.uint8))
        np.testing.assert_array_equal(host[2 * block:], np.arange(2 * block, 2 * MiB, dtype=np.uint64).astype(np.uint8))
    finally:
        backend.close()
