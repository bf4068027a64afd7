"""Does a copy of managed memory hold the calling thread, or the GPU? ``python -m bench.copy_wait``.

On an H200 (``bench/data/h200-um-micro-4.json``) matmuls issued after 2 GiB copies between
GPU-resident managed and pinned memory ran as long as both one after the other. If the call
returns only once its copy is done (the simulator's ``copy_host_wait``), a thread of umrt's own
for the copies helps; if the GPU runs it apart from everything else, it does not. Per row:
``*_call_s`` (the call's return), ``*_gpu_s`` (events around it on its stream), ``*_kernel_overlap``
(the share of the shorter that ran beside matmuls queued on another stream *before* it; 0:
serialized). Rows: copy out, copy back, prefetch to the host; ``device_copy_out`` (device memory
to the same pinned buffer: the control); ``sm_copy_out`` / ``sm_copy_back`` (umrt's SM copy kernel,
``umrt/backends/sm_copy.py``, moves the data through mapped pinned memory on a stream of the
greatest priority: the SMs drive the link; umrt's default swap copy; ``sm_copy_*_{4,8,32}_blocks``: the
same with other grids than umrt's 16, for how many blocks the link needs); ``revalidate_{2M,256K}_per_range_s`` /
``populate_{2M,256K}_per_range_s`` (a prefetch to the GPU of one discarded 2 MiB or 256 KiB range, its pages
kept or sent to the host: the simulator charges a migration's set-up, 81 us, unmeasured);
``small_prefetch_{alone,behind_memcpy,behind_sm_copy}_s`` (a 128 KiB prefetch to the GPU issued right after a
2 GiB copy back starts: the simulator has it wait for the copy). Needs about 8.5 GiB of GPU memory and 2 GiB
pinned; prints JSON (also to ``$OUT/copy_wait.json`` where ``OUT`` is set).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

N = 2 << 30


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"CUDA call failed: {result}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def run_rows(res: dict, rows, measure) -> None:
    """Each ``(name, call)`` in turn: ``measure(name, call)``'s figures (a dict) into ``res``; a
    row that fails gives its error as ``{name}_error`` and the others still run."""
    for name, call in rows:
        try:
            res.update(measure(name, call))
        except Exception as exc:  # noqa: BLE001 - a row that fails says why
            res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"


def report(res: dict, name: str) -> int:
    """Print ``res`` as JSON, also to ``$OUT/{name}.json`` where ``OUT`` is set; 0."""
    text = json.dumps(res, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"{name}.json").write_text(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.copy_wait", description=__doc__).parse_args(argv)  # (--help)
    try:
        import cupy as cp
        from cuda.bindings import runtime as rt

        from umrt.backends.sm_copy import SmCopyKernel

        assert cp.cuda.runtime.getDeviceCount() > 0, "no GPU"
    except Exception as exc:  # noqa: BLE001 - no cupy, no cuda-bindings, no GPU or no driver: one line
        print(f"bench.copy_wait needs cupy and cuda-bindings with a GPU: {exc}", file=sys.stderr)
        return 2

    def where(dev: int):  # a cudaMemLocation: the GPU, or the host (-1)
        loc, kinds = rt.cudaMemLocation(), rt.cudaMemLocationType
        loc.type, loc.id = (kinds.cudaMemLocationTypeHost, 0) if dev < 0 else (kinds.cudaMemLocationTypeDevice, dev)
        return loc

    err, _, greatest = rt.cudaDeviceGetStreamPriorityRange()
    _check(err)
    # as umrt's swap path makes its SM copies' streams: non-blocking, the greatest priority
    copy_stream = _check(rt.cudaStreamCreateWithPriority(rt.cudaStreamNonBlocking, greatest))
    compute = cp.cuda.Stream(non_blocking=True)
    pinned = _check(rt.cudaHostAlloc(N, rt.cudaHostAllocMapped))
    managed = [_check(rt.cudaMallocManaged(N, rt.cudaMemAttachGlobal)) for _ in range(3)]
    for p in managed:
        _check(rt.cudaMemPrefetchAsync(p, N, where(0), 0, copy_stream))
        cp.cuda.runtime.memsetAsync(p, 1, N, 0)
    a, b = (cp.random.rand(8192, 8192, dtype=cp.float32) for _ in range(2))
    cp.cuda.runtime.deviceSynchronize()

    def kernels() -> None:
        with compute:
            for _ in range(6):
                a @ b

    def measure(name: str, call) -> dict:
        ev = {k: _check(rt.cudaEventCreate()) for k in ("k0", "k1", "c0", "c1")}
        kernels(), cp.cuda.runtime.deviceSynchronize()  # warm
        _check(rt.cudaEventRecord(ev["k0"], compute.ptr))
        kernels()
        _check(rt.cudaEventRecord(ev["k1"], compute.ptr))
        _check(rt.cudaEventRecord(ev["c0"], copy_stream))
        t = time.perf_counter()
        call()
        call_s = time.perf_counter() - t
        _check(rt.cudaEventRecord(ev["c1"], copy_stream))
        cp.cuda.runtime.deviceSynchronize()

        def between(x: str, y: str) -> float:
            return _check(rt.cudaEventElapsedTime(ev[x], ev[y])) / 1e3

        k_s, c_s, start = between("k0", "k1"), between("c0", "c1"), between("k0", "c0")  # start: the copy's
        overlap = max(0.0, min(k_s, start + c_s) - max(0.0, start))
        return {f"{name}_call_s": call_s, f"{name}_gpu_s": c_s, f"{name}_kernels_s": k_s,
                f"{name}_kernel_overlap": overlap / max(1e-9, min(k_s, c_s))}

    res: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                 "driver": cp.cuda.runtime.driverGetVersion()}
    default = rt.cudaMemcpyKind.cudaMemcpyDefault
    sm_copy = SmCopyKernel()  # umrt's own (umrt/backends/sm_copy.py)

    def memcpy(dst, src) -> None:
        _check(rt.cudaMemcpyAsync(dst, src, N, default, copy_stream))

    def kernel_copy(src, dst, kernel=sm_copy) -> None:
        kernel(int(dst), int(src), N, copy_stream)

    grids = {b: SmCopyKernel(blocks=b) for b in (4, 8, 32)}  # beside umrt's 16: how many blocks the link needs

    device = cp.full(N, 1, cp.uint8)
    run_rows(res, (("copy_out", lambda: memcpy(pinned, managed[0])), ("copy_back", lambda: memcpy(managed[1], pinned)),
                   ("prefetch_to_host", lambda: _check(rt.cudaMemPrefetchAsync(managed[2], N, where(-1), 0,
                                                                              copy_stream))),
                   ("device_copy_out", lambda: memcpy(pinned, device.data.ptr)),
                   ("sm_copy_out", lambda: kernel_copy(managed[0], pinned)),
                   ("sm_copy_back", lambda: kernel_copy(pinned, managed[1])),
                   *((f"sm_copy_out_{b}_blocks", lambda k=k: kernel_copy(managed[0], pinned, k)) for b, k in grids.items()),
                   *((f"sm_copy_back_{b}_blocks", lambda k=k: kernel_copy(pinned, managed[1], k))
                     for b, k in grids.items())), measure)

    def populations(name: str, to_host: bool, size: int) -> dict:  # (name: the row's, e.g. revalidate_2M)
        """64 ranges of ``size`` bytes discarded (pages kept, or sent to the host with no copy), then
        each brought back by its own prefetch to the GPU: the cost per range of a population."""
        k, p = 64, managed[1]
        if to_host:
            _check(rt.cudaMemDiscardAndPrefetchBatchAsync([p], [k * size], 1, [where(-1)], [0], 1, 0, copy_stream))
        else:
            _check(rt.cudaMemDiscardBatchAsync([p], [k * size], 1, 0, copy_stream))
        ev = [_check(rt.cudaEventCreate()) for _ in range(2)]
        _check(rt.cudaEventRecord(ev[0], copy_stream))
        for i in range(k):
            _check(rt.cudaMemPrefetchAsync(p + i * size, size, where(0), 0, copy_stream))
        _check(rt.cudaEventRecord(ev[1], copy_stream))
        cp.cuda.runtime.deviceSynchronize()
        return {f"{name}_per_range_s": _check(rt.cudaEventElapsedTime(ev[0], ev[1])) / 1e3 / k}

    # 2 MiB (a block) and 256 KiB (the dead tensors a small model's runtime discards and sees
    # populated again a few events later, bench.loops at 25%): whether the set-up is per call
    run_rows(res, ((f"{kind}_{label}", (host, size)) for kind, host in (("revalidate", False), ("populate", True))
                   for label, size in (("2M", 2 << 20), ("256K", 256 << 10))),
             lambda name, arg: populations(name, *arg))

    def small_prefetch(name: str, copy) -> dict:
        """A 128 KiB prefetch of host-resident managed memory to the GPU on a stream of its own, right
        after ``copy`` (None: alone) starts on the copy stream: does it wait for the copy on the link?"""
        side, p, size = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)), managed[2], 128 << 10
        _check(rt.cudaMemPrefetchAsync(p, size, where(-1), 0, side))
        ev = [_check(rt.cudaEventCreate()) for _ in range(2)]
        cp.cuda.runtime.deviceSynchronize()
        if copy is not None:
            copy()
        _check(rt.cudaEventRecord(ev[0], side))
        _check(rt.cudaMemPrefetchAsync(p, size, where(0), 0, side))
        _check(rt.cudaEventRecord(ev[1], side))
        cp.cuda.runtime.deviceSynchronize()
        return {f"{name}_s": _check(rt.cudaEventElapsedTime(ev[0], ev[1])) / 1e3}

    # the simulator queues a migration behind the swap path's copies on its link (engine.py _queue)
    run_rows(res, (("small_prefetch_alone", None), ("small_prefetch_behind_memcpy", lambda: memcpy(managed[1], pinned)),
                   ("small_prefetch_behind_sm_copy", lambda: kernel_copy(pinned, managed[1]))), small_prefetch)
    return report(res, "copy_wait")


if __name__ == "__main__":
    sys.exit(main())
