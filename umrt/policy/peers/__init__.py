"""Peer systems re-implemented from their papers as policies over the same
backend interface, so the bench compares them with umrt side by side.

==============  ===============================================  =====================
name            paper                                            class
==============  ===============================================  =====================
``deepum``      DeepUM, ASPLOS 2023 (correlation prefetching)    :class:`DeepUMPolicy`
``sentinel``    Sentinel, HPCA 2021 (object-level migration)     :class:`SentinelPolicy`
``vdnn``        vDNN, MICRO 2016 (layer-wise offload)            :class:`VDNNPolicy`
``swapadvisor`` SwapAdvisor, ASPLOS 2020 (GA-searched swap plan) :class:`SwapAdvisorPolicy`
==============  ===============================================  =====================

Each constructor is ``cls(trace=None, **options)``. Only SwapAdvisor reads the
trace (it plans offline from the dataflow graph); the others learn online
from the events they are given, like the real systems.
"""
from umrt.policy.peers.deepum import DeepUMPolicy
from umrt.policy.peers.sentinel import SentinelPolicy
from umrt.policy.peers.swapadvisor import SwapAdvisorPolicy
from umrt.policy.peers.vdnn import VDNNPolicy

__all__ = ["DeepUMPolicy", "SentinelPolicy", "SwapAdvisorPolicy", "VDNNPolicy", "PEERS"]

PEERS = {
    "deepum": DeepUMPolicy,
    "sentinel": SentinelPolicy,
    "vdnn": VDNNPolicy,
    "swapadvisor": SwapAdvisorPolicy,
}
