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

import argparse
import sys
import time

from bench.copy_wait import report, run_rows

N = 1 << 30


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m bench.remote_write", description=__doc__).parse_args(argv)  # (--help)
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

    def advise(*pairs) -> None:
        for advice, device in pairs:
            backend.advise(whole, advice, device)

    undo = {"host_discarded_mapped": lambda: advise((Advice.UNSET_ACCESSED_BY, 0),
                                                    (Advice.UNSET_PREFERRED_LOCATION, HOST))}

    def timed(name: str, prepare) -> dict:  # prepare the pages, time the write, put them back on the GPU
        try:
            prepare()
            return {f"{name}_GBs": write()}
        finally:
            undo.get(name, lambda: None)()
            backend.prefetch(whole, 0)

    res: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode()}
    backend.prefetch(whole, 0)
    write()  # populated on the GPU
    run_rows(res, (("resident", lambda: None), ("discarded", lambda: backend.discard(whole)),
                   ("host_discarded_mapped", lambda: (backend.discard_and_prefetch(whole, HOST), advise(
                       (Advice.SET_PREFERRED_LOCATION, HOST), (Advice.SET_ACCESSED_BY, 0)))),
                   ("host_discarded", lambda: backend.discard_and_prefetch(whole, HOST))), timed)
    return report(res, "remote_write")


if __name__ == "__main__":
    sys.exit(main())
