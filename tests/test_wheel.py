"""The wheel built from the repository installs umrt alone (plus its start-up hook), with
the C++ sources as umrt's package data, found where an installed umrt looks for them."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("steady_alloc.cpp", "steady_front.cpp", "torch_alloc_shim.cpp")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel --no-deps --no-build-isolation`` of a copy of the repository's package
    files (building in the checkout would leave build/ there)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("umrt", "kernels", "bench"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "out", ".cache"))
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    if out.returncode != 0 and "No module named pip" in out.stderr:
        pytest.skip("pip is not available to build the wheel")
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = (tmp / "dist").glob("umrt-*.whl")
    return built


def test_the_wheel_installs_only_umrt_and_its_start_up_hook(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = sorted({n.split("/")[0] for n in names})
    print(f"\nthe wheel's top-level names: {top}")
    assert [t for t in top if not t.endswith(".dist-info")] == ["umrt", "umrt-activate.pth"], top
    assert not any(n.startswith(("bench/", "kernels/")) for n in names)
    assert all(f"umrt/native/{name}" in names for name in SOURCES)


def test_an_installed_umrt_finds_its_cpp_sources_in_the_package(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("from umrt.native.build import native_source; import umrt; "
            "print(umrt.__file__); print(*(native_source(n) for n in ('steady_alloc.cpp', 'steady_front.cpp', "
            "'torch_alloc_shim.cpp')), sep='\\n')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    if not lines[0].startswith(str(site)):
        pytest.skip(f"this environment's umrt ({lines[0]}) shadows the extracted wheel")
    assert lines[1:] == [str(site / "umrt" / "native" / name) for name in SOURCES]
    assert all(Path(p).read_bytes() == (ROOT / "umrt" / "native" / Path(p).name).read_bytes() for p in lines[1:])


def test_a_checkout_finds_its_cpp_sources_in_the_package():
    from umrt.native.build import native_source

    assert [native_source(name) for name in SOURCES] == [ROOT / "umrt" / "native" / name for name in SOURCES]
    assert not list((ROOT / "kernels").glob("*.cpp"))  # kernels/ holds the numba kernels only


def test_umrt_bench_without_the_repositorys_bench_says_so_in_one_line(monkeypatch, capsys):
    from umrt.cli import main

    monkeypatch.setitem(sys.modules, "bench.cli", None)  # an installed umrt: no bench package
    assert main(["bench", "--runs", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "checkout of umrt's repository" in err and "python -m bench" in err, err
