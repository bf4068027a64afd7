"""The UMRT=1 start-up hook, run in fresh interpreters.

Each case boots a subprocess that processes umrt's .pth line the way ``site``
does at start-up (``site.addsitedir`` on a folder holding only that file,
with ``sys.argv`` already set to the script), then runs the script. The
``UMRT*`` variables reach the subprocess as an argument and are set just
before that, so a hook installed in this interpreter's own site-packages
(``pip install -e`` puts one there) sees none of them at its real start-up.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from umrt.activation import PTH_LINE, PTH_NAME, install_pth

BOOT = textwrap.dedent("""
    import json, os, runpy, site, sys, types
    pth_dir, fake_shadow = sys.argv[1], sys.argv[2] == "1"
    os.environ.update(json.loads(sys.argv[3]))
    sys.argv = sys.argv[4:]
    if fake_shadow:  # stands in for umrt.shadow (engineer RUNTIME's module)
        mod = types.ModuleType("umrt.shadow")
        def run_shadow(script, argv, profile=None, gpu_memory=None, policy=None):
            print("SHADOW", script, argv, profile, gpu_memory, policy)
            return 7
        mod.run_shadow = run_shadow
        sys.modules["umrt.shadow"] = mod
    site.addsitedir(pth_dir)
    site.addsitedir(pth_dir)  # venvs may list site-packages twice: must stay idempotent
    print("LOADED", "umrt.activation" in sys.modules)
    runpy.run_path(sys.argv[0], run_name="__main__")
""")

SCRIPT = textwrap.dedent("""
    import sys
    print("ARGS", sys.argv[1:])
    if "--torch" in sys.argv:
        import torch
        import umrt.activation as a
        print("ENABLED_BY", a.enabled_by())
""")


@pytest.fixture
def boot(tmp_path):
    pth_dir = tmp_path / "site"
    pth_dir.mkdir()
    install_pth(pth_dir)
    (tmp_path / "boot.py").write_text(BOOT)
    (tmp_path / "train.py").write_text(SCRIPT)

    def run(env_extra: dict[str, str], *args: str, shadow: bool = False):
        env = {k: v for k, v in os.environ.items() if not k.startswith("UMRT")}
        return subprocess.run(
            [sys.executable, str(tmp_path / "boot.py"), str(pth_dir), "1" if shadow else "0",
             json.dumps(env_extra), str(tmp_path / "train.py"), *args],
            env=env, capture_output=True, text=True, timeout=120,
        )

    return run


def test_pth_file_is_one_import_line(tmp_path):
    path = install_pth(tmp_path)
    assert path.name == PTH_NAME and path.read_text() == PTH_LINE
    assert PTH_LINE.startswith("import ") and PTH_LINE.count("\n") == 1


@pytest.mark.parametrize("value", [None, "", "0", "off", "False"])
def test_off_values_do_not_even_import_umrt(boot, value):
    out = boot({} if value is None else {"UMRT": value}, "a", "b")
    assert out.returncode == 0, out.stderr
    assert "LOADED False" in out.stdout and "ARGS ['a', 'b']" in out.stdout and out.stderr == ""


def test_bad_values_stop_before_the_script(boot):
    out = boot({"UMRT": "maybe"})
    assert out.returncode == 2 and "ARGS" not in out.stdout
    assert out.stderr.startswith("umrt: error: UMRT='maybe'") and "Traceback" not in out.stderr
    out = boot({"UMRT": "1", "UMRT_GPU_MEMORY": "lots"})
    assert out.returncode == 2 and "UMRT_GPU_MEMORY" in out.stderr and "ARGS" not in out.stdout


@pytest.mark.parametrize("env, line", [
    ({"UMRT_PROFILE": "nope"}, "umrt: error: UMRT_PROFILE='nope': unknown hardware profile 'nope': not a file, "
                               "and not one of v100-pcie3-16g"),
    ({"UMRT_GPU_MEMORY": "20%peak"}, "umrt: error: UMRT_GPU_MEMORY='20%peak': a live run does not know the run's "
                                     "peak live bytes before it runs"),
    ({"UMRT_SIMULATE": "h100-pcie5-80g", "UMRT_GPU_MEMORY": "90%device"},
     "umrt: error: UMRT_GPU_MEMORY='90%device': a simulated GPU has no memory but its budget"),
])
def test_every_setting_is_checked_before_the_script_starts(boot, env, line):
    """As the README says of every knob (issue 22: UMRT_PROFILE was read only later)."""
    out = boot({"UMRT": "1", **env})
    assert out.returncode == 2 and "ARGS" not in out.stdout
    assert out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr


def test_enabled_waits_for_torch_then_runs_unchanged_without_gpu(boot):
    # "without a GPU" on any machine: CUDA_VISIBLE_DEVICES="" hides every device from the
    # CUDA runtime of the child (a GPU machine would otherwise really enable umrt there).
    out = boot({"UMRT": "1", "CUDA_VISIBLE_DEVICES": ""}, "--torch")
    assert out.returncode == 0, out.stderr
    assert "LOADED True" in out.stdout and "ENABLED_BY torch" in out.stdout
    assert out.stderr.count("no CUDA GPU found; running unchanged") == 1


def test_simulate_runs_the_script_in_shadow_mode(boot):
    out = boot({"UMRT": "yes", "UMRT_SIMULATE": "a100-pcie4-40g", "UMRT_GPU_MEMORY": "20%"}, "x", shadow=True)
    assert out.returncode == 7, out.stderr
    assert "SHADOW" in out.stdout and "['x'] a100-pcie4-40g 20% umrt" in out.stdout
    assert "ARGS" not in out.stdout  # the shadow run replaced the plain run


# -- umrt run ------------------------------------------------------------------
def _cli(argv):
    from umrt.cli import main

    return main(argv)


@pytest.fixture
def no_umrt_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("UMRT"):
            monkeypatch.delenv(k)
    import umrt.api

    monkeypatch.setattr(umrt.api, "gpu_count", lambda: 0)
    monkeypatch.setattr(umrt.api, "_said_no_gpu", False)


def test_run_without_gpu_runs_script_unchanged(tmp_path, capsys, no_umrt_env):
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint('ARGV', sys.argv[1:])\nsys.exit(5)\n")
    assert _cli(["run", str(script), "--lr", "3"]) == 5
    out = capsys.readouterr()
    assert "ARGV ['--lr', '3']" in out.out and out.err.count("no CUDA GPU found") == 1


def test_run_simulate_calls_shadow(tmp_path, monkeypatch, no_umrt_env):
    import types

    seen = {}
    shadow = types.ModuleType("umrt.shadow")
    shadow.run_shadow = lambda script, argv, **kw: seen.update(script=script, argv=argv, **kw) or 0
    monkeypatch.setitem(sys.modules, "umrt.shadow", shadow)
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run for real')\n")
    assert _cli(["run", "--simulate", "v100-pcie3-16g", "--gpu-memory", "20%", str(script), "x"]) == 0
    amount = seen.pop("gpu_memory")  # "20%" as shadow mode reads it: of the footprint the run needs
    assert (amount.fraction, amount.base, amount.text) == (0.2, "footprint", "20%")
    assert seen == {"script": str(script), "argv": ["x"], "profile": "v100-pcie3-16g", "policy": "umrt"}


def test_run_bad_input_exits_2(tmp_path, capsys, no_umrt_env):
    assert _cli(["run", str(tmp_path / "missing.py")]) == 2
    script = tmp_path / "s.py"
    script.write_text("")
    assert _cli(["run", "--gpu-memory", "lots", str(script)]) == 2
    assert "--gpu-memory='lots'" in capsys.readouterr().err


def test_shipped_pth_file_matches():
    import pathlib

    import umrt

    shipped = pathlib.Path(umrt.__file__).with_name(PTH_NAME)
    assert shipped.read_text() == PTH_LINE


# -- is the hook installed? ------------------------------------------------------
def test_hook_status_without_the_pth_says_umrt_1_does_nothing(tmp_path, monkeypatch, capsys):
    import umrt.activation as act

    monkeypatch.setattr(act, "site_dirs", lambda: [tmp_path])
    status = act.hook_status()
    assert status.path is None and not status.works
    assert "UMRT=1 does nothing here" in status.describe()
    assert act.main(["--check"]) == 2
    assert f"fix: {act.INSTALL_COMMAND}" in capsys.readouterr().out
    install_pth(tmp_path)
    status = act.hook_status(try_it=False)
    assert status.path == tmp_path / PTH_NAME and status.works
    assert act.main(["--print"]) == 0


def _copy_of_the_project(dest):
    """The files an install reads, copied (the test must not write build output into the checkout)."""
    import shutil

    import umrt

    root = Path(umrt.__file__).resolve().parents[1]
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "setup.cfg", "README.md"):
        shutil.copy(root / name, dest / name)
    for name in ("umrt", "kernels", "bench"):
        shutil.copytree(root / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".cache", "out"))
    return dest


def test_editable_install_installs_the_hook(tmp_path):
    """`pip install -e` (PEP 660) writes umrt-activate.pth too: UMRT=1 then activates, and a bad
    UMRT_* value stops the script with the variable named. The venv borrows this interpreter's
    site-packages (setuptools, numpy, ...) through a .pth, so nothing is downloaded."""
    pytest.importorskip("setuptools")
    pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip("pip is not available to this interpreter")
    project = _copy_of_the_project(tmp_path / "project")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    site_packages = Path(purelib)
    borrowed = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    (site_packages / "00-borrowed.pth").write_text("".join(f"{p}\n" for p in borrowed))
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMRT") and k != "PYTHONPATH"}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
         "--no-build-isolation", "--no-index", "-e", str(project)],
        env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    assert (site_packages / PTH_NAME).read_text() == PTH_LINE

    script = tmp_path / "train.py"
    script.write_text("import sys, umrt\nprint('ON' if 'umrt.activation' in sys.modules else 'OFF', umrt.__file__)\n")

    def run(**extra):
        return subprocess.run([str(python), str(script)], env={**env, **extra}, capture_output=True, text=True,
                              timeout=120)

    on = run(UMRT="1")
    assert on.returncode == 0 and on.stdout.startswith("ON " + str(project)), on.stdout + on.stderr
    off = run()
    assert off.returncode == 0 and off.stdout.startswith("OFF"), off.stdout + off.stderr
    bad = run(UMRT="1", UMRT_GPU_MEMORY="banana")
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert bad.stderr.startswith("umrt: error: UMRT_GPU_MEMORY='banana'"), bad.stderr
    check = subprocess.run([str(python), "-m", "umrt.activation", "--check"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0 and "UMRT=1 switches umrt on" in check.stdout, check.stdout + check.stderr
