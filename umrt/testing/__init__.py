"""Helpers for umrt's tests and quick experiments: synthetic traces (:mod:`umrt.testing.synthetic`).

Nothing here runs in a training job; it builds inputs for the simulator and the policies.
"""
