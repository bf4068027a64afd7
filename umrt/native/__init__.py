"""umrt's native steady state, in one package: the C++ it serves from, and the Python around it.

The C++ sources (package data, compiled at first use with torch's ``cpp_extension``):

* ``steady_alloc.cpp``: the steady schedule (one cycle of steady iterations served without
  Python) and its C tables of CUDA calls;
* ``steady_front.cpp``: the allocation front torch's shim and umrt's CuPy allocator call; it
  asks the installed schedule first, umrt's Python callbacks where it declines;
* ``torch_alloc_shim.cpp``: what torch's pluggable allocator calls (the front, or the
  callbacks), raising ``torch.cuda.OutOfMemoryError``; loaded by :mod:`umrt.allocators.torch`.

The Python, each file importing only those above it:

* :mod:`~umrt.native.constants`: the constants Python and C++ share, defined once (the C++
  gets them as a generated header);
* :mod:`~umrt.native.signatures`: every C function called through ctypes, declared once;
* :mod:`~umrt.native.build`: where the sources are, and building them;
* :mod:`~umrt.native.tables`: the CUDA tables a schedule's decisions call through;
* :mod:`~umrt.native.recorder`: recording a steady window;
* :mod:`~umrt.native.schedule`: compiling recorded windows into a schedule's arrays;
* :mod:`~umrt.native.twin`: the schedule in Python (the fallback, rule for rule the C++);
* :mod:`~umrt.native.binding`: the schedule in C++ through ctypes, its C tables, and
  :func:`~umrt.native.binding.load_steady` (the native one where it builds);
* :mod:`~umrt.native.front`: the allocation front through ctypes;
* :mod:`~umrt.native.server`: :class:`~umrt.native.server.SteadyServer`, the allocator torch
  and CuPy call: it learns the steady state from the live program and serves it natively.
"""
