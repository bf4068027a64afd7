"""Does a kernel refault on pages discarded and prefetched to the host? ``python -m bench.remote_write``.

A launch larger than the budget writes its newborn over the link: umrt discards the newborn's
pages and prefetches them to the host (``cudaMemDiscardAndPrefetchBatchAsync``), then sets
PreferredLocation=host and AccessedBy=GPU (``Plan.remote_fresh``). The simulator takes that
write as a remote one; the fake CUDA runtime of the tests as the refault path measured on the
H100 at 0.8 GB/s (pages discarded on the GPU, then written). Neither is measured. Each row is a
kernel writing 1 GiB of managed memory (GB/s): ``resident`` (on the GPU), ``discarded``
(discarded there first), ``host_discarded_mapped`` (as umrt's plan leaves it) and
``host_discarded`` (the same without the advice). Prints JSON (also to ``$OUT/remote_write.json``).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

N = 1 << 30


def main() -> int:
    try:
        import cupy as cp

        from umrt.backends.base import HOST, Advice
        from umrt.backends.cuda import CudaBackend

        backend = CudaBackend(0)
    except Exception as exc:  # noqa: BLE001 - no cupy, no GPU or no driver: one line
        print(f"bench.remote_write needs cupy and a CUDA GPU: {exc}", file=sys.stderr)
        return 2
    ptr = backend.malloc(N)
    buf = cp.ndarray((N // 8,), cp.uint64, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, N, None, 0), 0))
    whole = [(ptr, N)]

    def write() -> float:
        backend.synchronize()
        t = time.perf_counter()
        buf.fill(7)
        cp.cuda.runtime.deviceSynchronize()
        return N / (time.perf_counter() - t) / 1e9

    def host_discarded(mapped: bool) -> float:
        backend.discard_and_prefetch(whole, HOST)
        if mapped:
            backend.advise(whole, Advice.SET_PREFERRED_LOCATION, HOST)
            backend.advise(whole, Advice.SET_ACCESSED_BY, 0)
        rate = write()
        if mapped:
            backend.advise(whole, Advice.UNSET_ACCESSED_BY, 0)
            backend.advise(whole, Advice.UNSET_PREFERRED_LOCATION, HOST)
        backend.prefetch(whole, 0)
        return rate

    res: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    backend.prefetch(whole, 0)
    write()  # populated on the GPU
    for name, run in (("resident", write), ("discarded", lambda: (backend.discard(whole), write())[1]),
                      ("host_discarded_mapped", lambda: host_discarded(True)),
                      ("host_discarded", lambda: host_discarded(False))):
        try:  # a row that fails says why; the others still run
            res[f"{name}_GBs"] = run()
        except Exception as exc:  # noqa: BLE001
            res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            backend.prefetch(whole, 0)
    text = json.dumps(res, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "remote_write.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
