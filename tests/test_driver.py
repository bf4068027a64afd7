"""The Driver: the one loop that feeds events to a policy, its layout and a backend,
in the order the event contract (umrt/policy/base.py) states."""
from __future__ import annotations

import pytest

from umrt.backends.base import Backend
from umrt.drive import Driver
from umrt.errors import DataIntegrityError, TraceFormatError
from umrt.hardware import load_profile
from umrt.memory.base import Layout
from umrt.policy import make_policy
from umrt.policy.base import Policy, PolicyContext
from umrt.sim.backend import SimBackend
from umrt.testing.synthetic import training_trace
from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch, LayerEnter, LayerExit

MIB = 1 << 20


class Log(list):
    """Every call any party received, in order."""


class LoggingPolicy(Policy):
    name = "logging"

    def __init__(self, log: Log, wants_launches: bool = True) -> None:
        self.log, self.wants_launches = log, wants_launches

    def on_event(self, event) -> None:
        self.log.append(("policy", type(event).__name__))


class LoggingLayout(Layout):
    def __init__(self, log: Log) -> None:
        self.log, self.where, self.next = log, {}, 1 << 30

    def alloc(self, obj, nbytes, kind) -> int:
        self.log.append(("layout.alloc", obj))
        self.where[obj] = self.next
        self.next += 4 * MIB
        return self.where[obj]

    def free(self, obj) -> None:
        self.log.append(("layout.free", obj))
        del self.where[obj]

    def address(self, obj) -> int:
        return self.where.get(obj, 0)

    def footprint(self) -> int:
        return 0


class LearningLogLayout(LoggingLayout):
    """A LearningLayout: the driver feeds it the stream."""

    def observe(self, event) -> None:
        self.log.append(("layout.observe", type(event).__name__))

    def observe_launch(self, exec_id) -> None:
        self.log.append(("layout.observe_launch", exec_id))


class LoggingBackend(Backend):
    def __init__(self, log: Log) -> None:
        self.log = log

    def malloc(self, nbytes):
        raise NotImplementedError

    def free(self, ptr):
        raise NotImplementedError

    def prefetch(self, ranges, device):
        pass

    def discard(self, ranges):
        pass

    def advise(self, ranges, advice, device):
        pass

    def launch(self, reads, writes, flops=0, nbytes=0, precision=""):
        self.log.append(("backend.launch", tuple(reads), tuple(writes)))

    def synchronize(self):
        pass

    def mem_info(self):
        return (0, 0)


class ContentsBackend(LoggingBackend):
    """A SimulatedContents backend: told of host-written and dead ranges, read at boundaries."""

    peak_resident_bytes = 7

    def mark_host_written(self, ranges):
        self.log.append(("backend.host_written", tuple(ranges)))

    def mark_dead(self, ranges):
        self.log.append(("backend.dead", tuple(ranges)))

    def check_defined(self, ranges):
        self.log.append(("backend.check_defined", tuple(ranges)))

    def counters(self):
        self.log.append(("backend.counters",))
        return {"time_s": 0.0}

    def reset_peak(self):
        self.log.append(("backend.reset_peak",))


EVENTS = [
    IterationBoundary(0),
    Alloc(1, MIB, Kind.PARAMETER, -1),
    LayerEnter("m"),
    Alloc(2, MIB, Kind.ACTIVATION, 0),
    Launch(0, 9, "aten::mm.default", (Access(1, 0, MIB, False), Access(2, 64, 128, True)), 10, 10, "m"),
    Free(2),
    LayerExit("m"),
    IterationBoundary(1),
]


def _driver(layout_class=LoggingLayout, backend_class=LoggingBackend, **kwargs):
    log = Log()
    policy, layout, backend = LoggingPolicy(log), layout_class(log), backend_class(log)
    return log, Driver(policy, layout, backend, **kwargs)


def test_the_event_contract_order():
    log, driver = _driver(LearningLogLayout, ContentsBackend)
    driver.feed_all(EVENTS)
    base = 1 << 30
    assert log == [
        ("backend.counters",), ("backend.reset_peak",), ("layout.observe", "IterationBoundary"),
        ("policy", "IterationBoundary"),
        ("layout.alloc", 1), ("backend.host_written", ((base, MIB),)), ("policy", "Alloc"),
        ("layout.observe", "LayerEnter"), ("policy", "LayerEnter"),
        ("layout.alloc", 2), ("policy", "Alloc"),
        ("layout.observe_launch", 9), ("policy", "Launch"),
        ("backend.launch", ((base, MIB),), ((base + 4 * MIB + 64, 128),)),
        ("policy", "Free"), ("backend.dead", ((base + 4 * MIB, MIB),)), ("layout.free", 2),
        ("layout.observe", "LayerExit"), ("policy", "LayerExit"),
        ("backend.counters",), ("backend.reset_peak",), ("layout.observe", "IterationBoundary"),
        ("policy", "IterationBoundary"),
    ]
    assert driver.addresses == {1: (base, MIB)} and driver.events == len(EVENTS)
    assert driver.peaks == [7] and len(driver.marks) == 2


def test_a_plain_layout_and_backend_get_only_the_base_calls():
    log, driver = _driver()
    driver.feed_all(EVENTS)
    assert not any(who.startswith(("layout.observe", "backend.counters", "backend.dead", "backend.host"))
                   for who, *_ in log)
    assert driver.marks == [] and driver.peaks == []


def test_one_at_a_time_is_the_same_as_a_batch():
    batch_log, batch = _driver(LearningLogLayout, ContentsBackend)
    batch.feed_all(EVENTS)
    single_log, single = _driver(LearningLogLayout, ContentsBackend)
    for ev in EVENTS:
        single.feed(ev)
    assert single_log == batch_log and single.events == batch.events


def test_a_launch_of_an_object_never_placed():
    stray = Launch(0, 1, "aten::add.Tensor", (Access(99, 0, 8, True),), 1, 1)
    log, driver = _driver(strict=True)
    with pytest.raises(TraceFormatError, match="object 99"):
        driver.feed(stray)
    log, driver = _driver()  # live: memory umrt did not allocate is skipped
    driver.feed(stray)
    assert log[-1] == ("backend.launch", (), ())


def test_an_id_allocated_again_releases_the_old_object_first():
    log, driver = _driver()
    driver.feed_all([Alloc(1, MIB, Kind.OTHER), Alloc(1, 2 * MIB, Kind.OTHER)])
    assert log == [("layout.alloc", 1), ("policy", "Alloc"), ("layout.free", 1), ("layout.alloc", 1),
                   ("policy", "Alloc")]
    assert driver.addresses[1][1] == 2 * MIB


def test_a_free_of_an_unknown_object_reaches_nobody():
    log, driver = _driver()
    driver.feed(Free(5))
    assert log == [] and driver.events == 1


def test_launches_on_demand_follow_the_policy_and_still_run():
    log, driver = _driver(LearningLogLayout, launches_on_demand=True)
    driver.policy.wants_launches = False
    driver.feed_all(EVENTS[:5])
    assert ("policy", "Launch") not in log and driver.launches_held_back == 1
    assert ("layout.observe_launch", 9) in log and log[-1][0] == "backend.launch"
    driver.policy.wants_launches = True
    driver.feed(EVENTS[4])
    assert log[-2] == ("policy", "Launch") and driver.launches_held_back == 1


def test_a_source_says_a_launch_was_not_shown():
    log, driver = _driver()
    driver.feed_all(EVENTS[:4])
    driver.feed(EVENTS[4], shown=False)
    assert ("policy", "Launch") not in log and driver.launches_held_back == 1 and log[-1][0] == "backend.launch"


def test_a_lost_write_names_the_launch_and_the_policy():
    class Losing(LoggingBackend):
        def launch(self, reads, writes, flops=0, nbytes=0, precision=""):
            raise DataIntegrityError("read of undefined data")

    log, driver = _driver(backend_class=Losing)
    with pytest.raises(DataIntegrityError, match=r"launch #0 aten::mm.default in m reading object\(s\) 1, "
                                                 r"under policy 'logging'"):
        driver.feed_all(EVENTS)


def _simulated_driver(budget: int) -> Driver:
    """Plain Unified Memory on the simulator (h100-pcie5-80g) with ``budget`` bytes, strict."""
    profile = load_profile("h100-pcie5-80g")
    policy = make_policy("um")
    backend = SimBackend(profile, budget)
    layout = policy.make_layout(backend)
    policy.attach(PolicyContext(backend, layout, budget, profile))
    return Driver(policy, layout, backend, profile=profile, strict=True)


@pytest.mark.parametrize("op, lost", [("aten::mul_.Scalar", True), ("aten::_foreach_lerp_.Scalar", True),
                                      ("aten::fill_.Scalar", False), ("aten::mul.Tensor", False)])
def test_an_in_place_update_of_memory_that_holds_nothing_is_a_lost_read(op, lost):
    """A kernel's newborn, never written, then updated in place (x.mul_(2) reads x): the simulator
    says which launch read nothing. An overwrite (fill_) or an out-of-place op reads nothing there."""
    driver = _simulated_driver(1 << 30)
    events = [IterationBoundary(0), Alloc(1, 1 << 20, Kind.OPTIMIZER_STATE, launch=0),
              Launch(0, 1, op, (Access(1, 0, 1 << 20, True),), 10**6, 0), IterationBoundary(1)]
    if not lost:
        driver.feed_all(events)
        return
    with pytest.raises(DataIntegrityError, match=rf"launch #0 {op} in top level reading object\(s\) 1, "):
        driver.feed_all(events)


def test_iteration_figures_of_a_simulated_run():
    """Marks, peaks and the ideal time per iteration: what simulate() and shadow mode report."""
    trace = training_trace(layers=4, steps=3)
    driver = _simulated_driver(1 << 34)
    driver.feed_all(trace.events)
    boundaries = sum(isinstance(e, IterationBoundary) for e in trace.events)
    assert len(driver.marks) == boundaries and len(driver.peaks) == boundaries - 1
    assert len(driver.ideal_s) == boundaries + 1 and all(t > 0 for t in driver.ideal_s[1:-1])
    steady = driver.steady()
    assert steady["time_s"] == driver.iteration_times()[-1] and steady["ideal_time_s"] == driver.ideal_s[-2]
