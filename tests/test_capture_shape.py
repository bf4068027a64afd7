"""The capture package keeps the shape issue 12 gave it: no class over 25 methods,
no umrt import inside a function, no getattr probe of torch's objects."""

from __future__ import annotations

from bench.architecture import measure


def test_capture_classes_are_small_and_import_at_module_top():
    shape = measure()
    capture = {c.name: c for c in shape.classes if c.name.startswith("umrt.capture.")}
    assert {"umrt.capture.recorder.Recorder", "umrt.capture.recorder.RecorderHooks"} <= set(capture)
    assert all(c.methods <= 25 for c in capture.values()), {n: c.methods for n, c in capture.items()}
    assert not [f for f in shape.function_imports if f.startswith("umrt/capture/")]
    # the one probe left is of transformers' version, not torch's
    assert [p.split()[-1] for p in shape.getattr_probes if p.startswith("umrt/capture/")] == [
        "find_packed_sequence_indices"
    ]
