"""Helpers for umrt's tests, quick experiments and CPU benches: synthetic traces
(:mod:`umrt.testing.synthetic`) and a fake backend's memory half, a bump allocator
(:mod:`umrt.testing.fake_backend`).

Nothing here runs in a training job; it builds inputs for the simulator, the policies and the layouts.
"""
