"""umrt's pool on a real training loop's trace (a 12-layer transformer language model in
plain PyTorch, 4 x 128 tokens, AdamW, recorded on meta), replayed through bench.pool: as
tight as issue 4 asked (footprint <= 1.03 x peak live bytes) and deterministic, fed as
the simulator feeds it and as a live run does. Only addresses and byte counts: nothing
is timed."""
from __future__ import annotations

import pytest
import torch

from bench.pool import TARGET_VS_LIVE, BumpBackend, replay
from umrt.capture import Recorder
from umrt.memory.caching import CachingAllocatorLayout
from umrt.memory.pool import LifetimePool

VOCAB, WIDTH, LAYERS = 4096, 512, 12


@pytest.fixture(scope="module")
def trace():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny meta ops: one intra-op thread is faster on a shared CPU
    try:
        with torch.device("meta"):
            model = torch.nn.Sequential(
                torch.nn.Embedding(VOCAB, WIDTH),
                *[torch.nn.TransformerEncoderLayer(WIDTH, 8, 4 * WIDTH, batch_first=True) for _ in range(LAYERS)],
                torch.nn.Linear(WIDTH, VOCAB),
            )
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        rec = Recorder(model, opt)
        with rec:
            for _ in range(4):  # the live feed plans once a step repeats the one before
                with rec.paused():
                    tokens = torch.randint(0, VOCAB, (4, 128), device="meta")
                logits = model(tokens)
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del logits, tokens
        return rec.trace()
    finally:
        torch.set_num_threads(threads)


def test_the_pool_is_tight_and_stable_on_a_real_trace(trace):
    pool = replay(trace, LifetimePool(BumpBackend()), feed=True)
    caching = replay(trace, CachingAllocatorLayout(BumpBackend()), feed=False)
    assert pool["peak_live"] == caching["peak_live"] > 0
    assert pool["footprint"] <= TARGET_VS_LIVE * pool["peak_live"]
    assert pool["footprint"] <= caching["footprint"]
    assert pool["stable"] == 1.0 and caching["stable"] == 1.0


def test_the_pool_fed_as_a_live_run_is_as_tight_and_stable(trace):
    """Kinds unknown at allocation (hinted while learning), no launches: every steady
    allocation at the address it had the iteration before, within the same target."""
    live = replay(trace, LifetimePool(BumpBackend(), live_feed=True), feed=True, live_feed=True)
    assert live["stable"] == 1.0
    assert live["footprint"] <= TARGET_VS_LIVE * live["peak_live"]
