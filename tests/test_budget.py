"""What a simulated budget means: a percentage of the footprint the run needs (umrt.sim.budget)."""
from __future__ import annotations

import pytest

from umrt.config import read_amount
from umrt.errors import ConfigError
from umrt.sim.budget import Budget, Needs, needs, needs_of_events, parse_budget, resolve_budget
from umrt.sim.replay import simulate
from umrt.testing.synthetic import training_trace
from umrt.trace.events import Alloc, Free, IterationBoundary, Kind, Trace, TraceHeader

MB = 1 << 20


def test_the_footprint_is_what_the_hungrier_layout_obtains():
    # Six 8 MB parameters: PyTorch's caching allocator serves sizes of 1-10 MB from
    # 20 MB segments, two per segment (60 MB); umrt's pool packs them in 48 MB.
    n = needs_of_events([Alloc(o, 8 * MB, Kind.PARAMETER) for o in range(6)])
    assert n == Needs(peak_live_bytes=48 * MB, pool_bytes=48 * MB, caching_bytes=60 * MB)
    assert n.footprint_bytes == 60 * MB and n.base_bytes("peak") == 48 * MB
    # An object freed before the next is born: the layouts reuse its memory, peak live counts it once.
    n = needs_of_events([Alloc(1, 64 * MB, Kind.ACTIVATION), Free(1), Alloc(2, 64 * MB, Kind.ACTIVATION)])
    assert n.peak_live_bytes == 64 * MB and n.footprint_bytes == 64 * MB


def test_needs_are_computed_once_per_trace():
    trace = training_trace(layers=2, steps=2)
    assert needs(trace) is needs(trace)
    other = training_trace(layers=3, steps=2)
    assert needs(other).footprint_bytes > needs(trace).footprint_bytes


def test_one_hundred_percent_fits_where_peak_live_did_not():
    """The issue's symptom: at "100%" of peak live bytes plain um thrashed, the layout needing more."""
    trace = training_trace()
    n = needs(trace)
    assert n.footprint_bytes > n.peak_live_bytes
    fits = simulate(trace, "um", "h100-pcie5-80g", "100%")
    assert fits.budget_bytes == n.footprint_bytes
    assert fits.evictions == 0 and fits.iteration_time_s == pytest.approx(fits.ideal_time_s)
    old = simulate(trace, "um", "h100-pcie5-80g", "100%", budget_base="peak")
    assert old.budget_bytes == n.peak_live_bytes and old.evictions > 0
    assert old.iteration_time_s > 2 * fits.iteration_time_s


def test_every_result_says_what_its_budget_is():
    trace = training_trace()
    r = simulate(trace, "um", "h100-pcie5-80g", "20%").to_json()
    n = needs(trace)
    assert r["budget_bytes"] == int(n.footprint_bytes * 0.2)
    assert r["budget_base"] == "footprint" and r["budget_text"] == "20%"
    assert r["budget_of_footprint"] == pytest.approx(0.2, abs=1e-9)
    assert r["budget_of_peak"] == pytest.approx(0.2 * n.footprint_bytes / n.peak_live_bytes, abs=1e-9)
    assert r["needed_footprint_bytes"] == n.footprint_bytes and r["peak_live_bytes"] == n.peak_live_bytes
    assert r["budget_description"].startswith("budget 64.0 MiB = 20% of the footprint 320.0 MiB (peak live 264.0 MiB)")
    sized = simulate(trace, "um", "h100-pcie5-80g", "52MiB").to_json()
    assert sized["budget_bytes"] == 52 * MB and "= 16.2% of the footprint" in sized["budget_description"]


def test_describe_names_both_bases():
    n = Needs(peak_live_bytes=10 << 30, pool_bytes=11 << 30, caching_bytes=12 << 30)
    b = resolve_budget("50%", n, "peak")
    assert b.bytes == 5 << 30
    assert b.describe() == ("budget 5.0 GiB = 41.7% of the footprint 12.0 GiB (peak live 10.0 GiB; "
                            "given as 50% of peak live)")
    assert Budget(6 << 30, "6GiB", "footprint", n).describe() == (
        "budget 6.0 GiB = 50% of the footprint 12.0 GiB (peak live 10.0 GiB)")


@pytest.mark.parametrize("budget", ["", "abc", "-5%", "0%", "10 parsecs", "1MB", True, None, "nan", "%"])
def test_one_parser_one_message(budget):
    with pytest.raises(ConfigError) as err:
        parse_budget(budget, 1000 * MB)
    text = str(err.value)
    assert repr(budget) in text
    assert ("percentage" in text and "'8GiB'" in text) or "above 0%" in text or "below one 2 MB block" in text


def test_percentages_and_bases():
    gib = 1 << 30
    assert parse_budget("20%", 10 * gib) == 2 * gib and parse_budget(" 150 % ", 10 * gib) == 15 * gib
    assert parse_budget("8GiB", 10 * gib) == 8 * gib
    assert read_amount("20%").fraction == pytest.approx(0.2) and read_amount("8GiB").fraction is None
    with pytest.raises(ConfigError, match="above 0%"):
        parse_budget("0%", 10 * gib)
    assert parse_budget("footprint/2", 10 * gib) == 5 * gib  # bench.gpu's old spelling of 50%
    with pytest.raises(ConfigError, match="budget base"):
        resolve_budget("20%", Needs(1 << 30, 1 << 30, 1 << 30), "device")
    with pytest.raises(ConfigError, match="invalid budget 'twenty'"):
        parse_budget("twenty", 1 << 30, "peak")


def test_a_percentage_names_its_base():
    """'20%' is of the footprint, '20%peak' of peak live bytes, in one value; a live run's base (the GPU's
    memory) is a clear error in a simulated run, whose GPU's memory is the budget itself."""
    n = Needs(peak_live_bytes=100 * MB, pool_bytes=180 * MB, caching_bytes=200 * MB)
    assert resolve_budget("20%", n).bytes == resolve_budget("20%footprint", n).bytes == 40 * MB
    peak = resolve_budget("20%peak", n)
    assert (peak.bytes, peak.base) == (20 * MB, "peak")
    assert peak.describe() == "budget 20.0 MiB = 10% of the footprint 200.0 MiB (peak live 100.0 MiB; given as 20% " \
                              "of peak live)"
    assert resolve_budget("20%", n, "peak").bytes == 20 * MB  # the old --budget-base peak: a bare 20%
    assert resolve_budget("20%footprint", n, "peak").bytes == 40 * MB  # a base in the value wins
    for text in ("20%device", "20%budget"):
        with pytest.raises(ConfigError, match="a simulated GPU has no memory but its budget"):
            resolve_budget(text, n)


def test_an_id_allocated_again_replaces_its_object():
    events = [IterationBoundary(0), Alloc(1, 8 * MB, Kind.OTHER), Alloc(1, 8 * MB, Kind.OTHER), IterationBoundary(1)]
    trace = Trace(TraceHeader(2, "t", "reused", "-", "meta", 1), events)
    assert needs(trace).peak_live_bytes == 8 * MB


def test_shadow_mode_sizes_its_gpu_from_the_footprint_of_the_whole_run():
    """Shadow mode's GPU is sized from the footprint of the whole recorded run, as `umrt simulate`
    sizes it from the trace file: at "100%" the live-fed run holds everything."""
    from umrt.hardware import load_profile
    from umrt.shadow import drive_live

    trace = training_trace()
    budget = resolve_budget("100%", trace)
    assert budget.bytes == needs(trace).footprint_bytes == needs_of_events(trace.events).footprint_bytes
    run = drive_live(trace.events, "um", load_profile("h100-pcie5-80g"), budget.bytes)
    assert run.error is None and run.steady()["evictions"] == 0  # "100%" holds everything


def test_a_budget_far_above_the_footprint_reads_without_an_exponent():
    from umrt.sim.needs import percent as _pct

    assert [_pct(f) for f in (0.2, 0.735, 37.46, float("nan"))] == ["20%", "73.5%", "3,746%", "?%"]


def test_the_footprint_is_what_a_run_with_that_memory_holds():
    """100% of the footprint is the memory a run needs with nothing evicted: umrt's runtime then
    lets its pool lay out no plan (``needs_plan``), so the footprint takes the pool so, not one
    that planned regions beside its learning layout (on this loop with evaluations 300 MiB, where
    the run holds 222 MiB and PyTorch's caching allocator 240)."""
    from umrt.hardware import load_profile
    from umrt.shadow import drive_live

    trace = training_trace(layers=6, eval_every=2, steps=16)
    n = needs(trace)
    run = drive_live(trace.events, "umrt", load_profile("h100-pcie5-80g"), n.footprint_bytes)
    layout = run.driver.layout
    assert run.error is None and layout.plans_made == 0 and run.driver.backend.evictions == 0
    assert n.footprint_bytes == max(layout.footprint(), n.caching_bytes)
    # Half of it is short: there the runtime's pool plans (steps whose shapes repeat; these, with
    # an evaluation every other step, take turns strictly, and a caching allocator's cache serves them).
    half = drive_live(trace.events, "umrt", load_profile("h100-pcie5-80g"), n.footprint_bytes // 2)
    assert half.driver.layout.plans_made == 0 and half.driver.backend.evictions > 0
    thirds = training_trace(layers=6, eval_every=3, steps=16)
    half = drive_live(thirds.events, "umrt", load_profile("h100-pcie5-80g"), needs(thirds).footprint_bytes // 2)
    assert half.driver.layout.plans_made >= 1 and half.driver.backend.evictions > 0
