"""bench.served: the H100 live run served through umrt's allocator, both paths (figures exist,
the paths agree; no timing is asserted)."""
from __future__ import annotations

import pytest

from bench.served import compare, main


@pytest.mark.slow
def test_compare_reports_both_paths_on_the_same_addresses():
    r = compare("40GiB", 40 << 30, 12, steady_from=9)
    assert r["same_addresses"] and r["native_steps"] >= 2
    assert r["python"]["report"]["phase"] == "off" and r["python"]["report"]["arms"] == 0
    assert r["native"]["report"]["arms"] == 1
    for path in ("python", "native"):
        assert r[path]["cpu_s"] >= 0 and r[path]["harness_cpu_s"] > 0


def test_bad_arguments_are_clean_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--budget", "banana"])
    assert exc.value.code == 2 and "--budget" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--iterations", "3"])
    assert exc.value.code == 2 and "at least 12" in capsys.readouterr().err
