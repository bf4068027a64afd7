"""The policy registry and the baseline policies (ideal, um, um-advise)."""
from __future__ import annotations

import pytest

from umrt.backends.base import Advice, Backend
from umrt.drive import Driver
from umrt.errors import ConfigError
from umrt.memory.base import Layout
from umrt.policy import POLICIES, POLICY_NAMES, available, make_policy, policy_class
from umrt.policy.base import Policy, PolicyContext
from umrt.trace.events import Access, Alloc, Free, IterationBoundary, Kind, Launch

# -- fakes -------------------------------------------------------------------------


class DictLayout(Layout):
    def __init__(self):
        self.addr, self.top = {}, 0x1000

    def alloc(self, obj, nbytes, kind):
        self.addr[obj] = self.top
        self.top += max(nbytes, 512)
        return self.addr[obj]

    def free(self, obj):
        del self.addr[obj]

    def address(self, obj):
        return self.addr[obj]

    def footprint(self):
        return self.top


class RecordingBackend(Backend):
    device = 0

    def __init__(self):
        self.calls = []

    def malloc(self, nbytes):
        raise NotImplementedError

    def free(self, ptr):
        raise NotImplementedError

    def prefetch(self, ranges, device):
        self.calls.append(("prefetch", list(ranges), device))

    def discard(self, ranges):
        self.calls.append(("discard", list(ranges)))

    def advise(self, ranges, advice, device):
        self.calls.append(("advise", list(ranges), advice, device))

    def launch(self, reads, writes, flops, nbytes, precision=""):
        self.calls.append(("launch",))

    def synchronize(self):
        pass


def run(policy: Policy, events):
    backend, layout = RecordingBackend(), DictLayout()
    policy.attach(PolicyContext(backend, layout, budget_bytes=1 << 30))
    Driver(policy, layout, backend).feed_all(events)
    return [c for c in backend.calls if c[0] != "launch"], layout


EVENTS = [
    Alloc(1, 4096, Kind.PARAMETER),
    Alloc(2, 4096, Kind.OPTIMIZER_STATE),
    IterationBoundary(0),
    Alloc(3, 8192, Kind.ACTIVATION),
    Launch(0, 7, "aten::mm", (Access(1, 0, 4096, False), Access(3, 0, 8192, True)), 10, 10),
    Alloc(4, 0, Kind.TEMPORARY),  # zero-byte objects get no advice
    Free(3),
    Free(4),
    IterationBoundary(1),
]


# -- registry ----------------------------------------------------------------------


def test_registry_names_every_policy_of_the_project():
    assert set(POLICY_NAMES) == {"ideal", "um", "um-advise", "oracle", "deepum", "sentinel", "vdnn",
                                 "swapadvisor", "umrt"}
    assert POLICIES["umrt"] == "umrt.policy.runtime:Runtime"


def test_unknown_policy_lists_the_valid_names():
    with pytest.raises(ConfigError, match="unknown policy 'lru'.*ideal, um, um-advise"):
        make_policy("lru")


def test_unavailable_policy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(POLICIES, "ghost", "umrt.policy.no_such_module:Ghost")
    with pytest.raises(ConfigError, match="'ghost' is unavailable"):
        policy_class("ghost")
    assert not available("ghost")
    monkeypatch.setitem(POLICIES, "ghost2", "umrt.policy.baselines:NoSuchClass")
    with pytest.raises(ConfigError, match="unavailable"):
        policy_class("ghost2")


def test_bad_option_is_a_config_error_naming_the_valid_ones():
    with pytest.raises(ConfigError, match="takes no option 'window'.*scheme"):
        make_policy("um-advise", window=3)
    with pytest.raises(ConfigError, match="takes no options"):
        make_policy("um", window=3)


# -- baselines -----------------------------------------------------------------------


def test_ideal_asks_for_unlimited_memory_and_moves_nothing():
    policy = make_policy("ideal")
    assert policy.unlimited_memory is True
    assert run(policy, EVENTS)[0] == []


def test_um_leaves_everything_to_the_driver():
    policy = make_policy("um")
    assert not getattr(policy, "unlimited_memory", False)
    assert run(policy, EVENTS)[0] == []


def test_um_advise_choi_lee_sets_advice_by_kind_at_alloc_and_withdraws_it_at_free():
    events = [*EVENTS[:2], Alloc(5, 4096, Kind.INPUT), *EVENTS[2:], Free(5)]
    calls, layout = run(make_policy("um-advise"), events)
    advice = [(c[2], c[3], c[1][0][1]) for c in calls]
    assert all(c[0] == "advise" for c in calls)
    # model parameters and their optimizer state stay on (and mapped by) the GPU
    assert advice[0:2] == [(Advice.SET_PREFERRED_LOCATION, 0, 4096), (Advice.SET_ACCESSED_BY, 0, 4096)]
    assert advice[2:4] == [(Advice.SET_PREFERRED_LOCATION, 0, 4096), (Advice.SET_ACCESSED_BY, 0, 4096)]
    # input data: a read-only copy on the GPU
    assert advice[4] == (Advice.SET_READ_MOSTLY, 0, 4096)
    # intermediate results (activation, temporary) get none; the input's advice is withdrawn at Free
    assert advice[5:] == [(Advice.UNSET_READ_MOSTLY, 0, 4096)]
    assert calls[4][1] == calls[5][1]  # same range set and unset


def test_um_advise_torch_uvm_scheme_advises_everything_alike():
    calls, _ = run(make_policy("um-advise", scheme="torch-uvm"), EVENTS)
    sets = [c for c in calls if c[2] in (Advice.SET_PREFERRED_LOCATION, Advice.SET_ACCESSED_BY)]
    assert {c[3] for c in sets} == {0}
    assert len(sets) == 6  # three non-empty objects, two advices each
    assert make_policy("um-advise").report()["scheme"] == "choi-lee"
    with pytest.raises(ConfigError, match="scheme"):
        make_policy("um-advise", scheme="magic")


def test_um_advise_never_prefetches_or_discards():
    calls, _ = run(make_policy("um-advise"), EVENTS)
    assert not [c for c in calls if c[0] in ("prefetch", "discard")]
