"""The names of umrt's policies, in a module that imports nothing.

:mod:`umrt.config` validates ``UMRT_POLICY`` against :data:`POLICY_NAMES` at
start-up without importing the policies (the plan layer); :mod:`umrt.policy`
re-exports both names and builds a policy from its ``"module:Class"`` path.
"""
from __future__ import annotations

__all__ = ["POLICIES", "POLICY_NAMES"]

# name -> "module:Class". Order = the order reports list them in.
POLICIES: dict[str, str] = {
    "ideal": "umrt.policy.baselines:IdealPolicy",
    "um": "umrt.policy.baselines:UMPolicy",
    "um-advise": "umrt.policy.baselines:UMAdvisePolicy",
    "oracle": "umrt.policy.oracle:OraclePolicy",
    "deepum": "umrt.policy.peers.deepum:DeepUMPolicy",
    "sentinel": "umrt.policy.peers.sentinel:SentinelPolicy",
    "vdnn": "umrt.policy.peers.vdnn:VDNNPolicy",
    "swapadvisor": "umrt.policy.peers.swapadvisor:SwapAdvisorPolicy",
    "umrt": "umrt.policy.runtime:Runtime",
}

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
