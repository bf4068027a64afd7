"""Several umrt jobs on one GPU: the per-device share registry (umrt.share).

In-process cases check the arithmetic and the registry; the subprocess cases are
real jobs on one (fake or simulated) GPU: shares held, a refused job's exit status
and message, and a killed job's share returned to the others.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from umrt import share
from umrt.share import FAIR, FIXED, Member, Registry, ShareError, join, refusal, targets

GiB = 2**30
TOTAL = 16 * GiB  # FakeGpu's default memory
ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _m(i: str, mode: str, want: int = 0, minimum: int = GiB, held: int = 0) -> Member:
    return Member(i, 1, mode, want, minimum, held)


def test_fair_jobs_split_what_the_fixed_shares_leave():
    members = [_m("a", FIXED, 4 * GiB), _m("b", FAIR), _m("c", FAIR)]
    due = targets(members, TOTAL)
    assert due["a"] == 4 * GiB
    assert due["b"] == due["c"] == int(0.9 * 12 * GiB / 2)
    assert targets([_m("b", FAIR)], TOTAL)["b"] == int(0.9 * TOTAL)  # alone: umrt's default 90%
    # never below a fair job's minimum
    assert targets([_m("a", FIXED, 15 * GiB), _m("b", FAIR, minimum=GiB)], TOTAL)["b"] == GiB


def test_a_share_is_refused_when_the_device_cannot_give_it():
    assert refusal([_m("a", FIXED, 10 * GiB)], _m("b", FIXED, 6 * GiB), TOTAL) is None
    why = refusal([_m("a", FIXED, 10 * GiB)], _m("b", FIXED, 7 * GiB), TOTAL)
    assert why and "17.0 GiB would be promised on a GPU of 16.0 GiB" in why
    # a fair job counts at its minimum: a fixed share may push it there, not below
    assert refusal([_m("f", FAIR, minimum=2 * GiB)], _m("b", FIXED, 14 * GiB), TOTAL) is None
    assert refusal([_m("f", FAIR, minimum=2 * GiB)], _m("b", FIXED, 15 * GiB), TOTAL)
    assert refusal([_m("a", FIXED, 14 * GiB)], _m("b", FAIR, minimum=2 * GiB), TOTAL) is None  # 2 GiB: its minimum
    why = refusal([_m("a", FIXED, 15 * GiB)], _m("b", FAIR, minimum=2 * GiB), TOTAL)
    assert why and "17.0 GiB would be promised" in why


def test_two_fixed_shares_over_the_device_get_one_clear_error(tmp_path):
    registry = Registry(tmp_path, "cuda-0")
    a = join(registry, TOTAL, fixed=10 * GiB, minimum=0, label="train_a.py", describe="cuda:0")
    try:
        with pytest.raises(ShareError) as exc:
            join(registry, TOTAL, fixed=8 * GiB, minimum=0, describe="cuda:0")
        text = str(exc.value)
        assert text.startswith("cuda:0 (16.0 GiB) cannot give this job its fixed 8.0 GiB (UMRT_GPU_MEMORY)")
        assert f"pid {os.getpid()} (train_a.py): 10.0 GiB fixed" in text and "UMRT_SHARE_WAIT" in text
        assert exc.value.exit_code == 2
        assert len(list(registry.folder.glob("*.json"))) == 1  # the refused job left nothing behind
    finally:
        a.close()
    b = join(registry, TOTAL, fixed=8 * GiB, minimum=0)  # a's share is free again
    assert b.held == 8 * GiB
    b.close()
    with pytest.raises(ShareError, match="cannot give this job the 20.0 GiB asked for"):
        join(registry, TOTAL, fixed=20 * GiB, minimum=0, describe="cuda:0")


def test_fair_shares_move_as_jobs_come_and_go_and_never_add_up_to_more_than_the_device(tmp_path):
    registry = Registry(tmp_path, "cuda-0")
    a = join(registry, TOTAL, fixed=None, minimum=GiB)
    assert a.held == int(0.9 * TOTAL) and a.mode == FAIR
    b = join(registry, TOTAL, fixed=None, minimum=GiB)  # starts with what a leaves free
    assert b.held == TOTAL - a.held and a.held + b.held <= TOTAL
    assert a.step() is None  # nothing flagged yet: a step costs one flag read
    half = int(0.9 * TOTAL / 2)
    assert a.poll() and a.step() == half  # a shrinks at its next step...
    assert b.poll() and b.step() == half  # ...then b grows into what a gave back
    assert a.held + b.held <= TOTAL and a.others == b.others == 1
    assert not a.poll() and a.step() is None
    b.close()
    assert a.poll() and a.step() == int(0.9 * TOTAL)  # b left: its share returns to a
    a.close()


def test_a_job_waits_for_a_share_if_asked(tmp_path):
    registry = Registry(tmp_path, "cuda-0")
    a = join(registry, TOTAL, fixed=12 * GiB, minimum=0)
    now = [0.0]

    def sleep(s):  # a leaves while b waits, after two polls
        now[0] += s
        if now[0] >= 2:
            a.close()

    b = join(registry, TOTAL, fixed=8 * GiB, minimum=0, wait=math.inf, clock=lambda: now[0], sleep=sleep)
    assert b.held == 8 * GiB and now[0] == 2
    b.close()
    a = join(registry, TOTAL, fixed=12 * GiB, minimum=0)
    with pytest.raises(ShareError, match="cannot give this job"):
        join(registry, TOTAL, fixed=8 * GiB, minimum=0, wait=3, clock=lambda: now[0],
             sleep=lambda s: now.__setitem__(0, now[0] + s))
    a.close()


HOLDER = textwrap.dedent("""
    import sys, time
    from umrt.share import Registry, join
    share = join(Registry(sys.argv[1], "cuda-0"), 16 * 2**30, fixed=int(sys.argv[2]), minimum=0, label="holder")
    print("HELD", share.held, flush=True)
    time.sleep(600)
""")


def test_a_killed_jobs_share_returns(tmp_path):
    """The kernel drops a dead process's lock: kill -9 leaves a file that the next look deletes."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), str(12 * GiB)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["HELD", str(12 * GiB)]
        registry = Registry(tmp_path, "cuda-0")
        with registry.locked():
            assert [m.pid for m in registry.members()] == [proc.pid]
        with pytest.raises(ShareError, match=f"pid {proc.pid} \\(holder\\): 12.0 GiB fixed"):
            join(registry, TOTAL, fixed=8 * GiB, minimum=0)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    b = join(registry, TOTAL, fixed=8 * GiB, minimum=0)
    assert b.held == 8 * GiB and not list(registry.folder.glob(f"{proc.pid}-*.json"))
    b.close()


# -- umrt jobs on one fake GPU (the fake CUDA runtime of tests/fake_cuda.py) -----------------

JOB = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from fake_cuda import FakeCupyRuntime, FakeGpu
    import umrt.activation, umrt.api as api, umrt.backends.cuda as cuda_mod
    from umrt.backends.cuda import CupyApi

    gpu = FakeGpu()  # 16 GiB
    cuda_mod.default_api = lambda: CupyApi(FakeCupyRuntime(gpu))
    api.gpu_count = lambda: 1
    api._attach_runtime = lambda session: None
    os.environ["UMRT"] = "1"  # only now: at start-up the real hook would have looked for a real GPU
    umrt.activation.install_import_hook()  # what UMRT=1 does once torch is imported: exits 2 on an error
    session = api.current()
    print("BUDGET", session.budget_bytes, flush=True)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    last = session.budget_bytes
    for step in range(int(os.environ.get("STEPS", "100000"))):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if session.budget_bytes != last:
            last = session.budget_bytes
            print("BUDGET", last, flush=True)
        time.sleep(0.05)
""").format(tests=str(TESTS))


def _job(tmp_path: Path, **env_extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMRT")}
    env.update(PYTHONPATH=str(ROOT), UMRT_SHARE_DIR=str(tmp_path), **env_extra)
    return subprocess.Popen([sys.executable, "-c", JOB], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _budget(proc: subprocess.Popen, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("BUDGET"):
            return int(line.split()[1])
        if not line and proc.poll() is not None:
            raise AssertionError(f"job ended ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    raise AssertionError("no budget line in time")


@pytest.mark.slow
def test_two_jobs_on_one_gpu_hold_fair_shares_and_a_killed_jobs_share_returns(tmp_path):
    a = _job(tmp_path)
    b = None
    try:
        assert _budget(a) == int(0.9 * TOTAL)  # alone: 90% of the device
        b = _job(tmp_path)
        first_b = _budget(b)
        assert first_b == TOTAL - int(0.9 * TOTAL)  # what a left free, until a shrinks
        half = int(0.9 * TOTAL / 2)
        assert _budget(a) == half  # a shrank at one of its steps...
        assert _budget(b) == half  # ...and b grew into it: together within the device
        b.send_signal(signal.SIGKILL)
        b.wait(timeout=60)
        assert _budget(a) == int(0.9 * TOTAL)  # b's share returned to a
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    assert "shared with 1 other umrt job(s): this job plans with" in b.stderr.read()
    assert "share moved from 7.2 GiB to 14.4 GiB (0 other umrt job(s))" in a.stderr.read()


@pytest.mark.slow
def test_a_job_whose_fixed_share_does_not_fit_exits_2_with_one_clear_line(tmp_path):
    # a job holding 10 GiB of the 16 GiB GPU (this process: its share is what the registry shows)
    a = join(Registry(tmp_path, "cuda-0"), TOTAL, fixed=10 * GiB, minimum=0, label="train_a.py")
    try:
        b = _job(tmp_path, UMRT_GPU_MEMORY="8GiB")
        out, err = b.communicate(timeout=120)
        assert b.returncode == 2 and "BUDGET" not in out
        assert err.strip().splitlines() == [
            "umrt: error: cuda:0 (16.0 GiB) cannot give this job its fixed 8.0 GiB (UMRT_GPU_MEMORY): 18.0 GiB "
            "would be promised on a GPU of 16.0 GiB (fixed shares, and each fair job at its minimum). umrt jobs on "
            f"it hold 10.0 GiB (pid {os.getpid()} (train_a.py): 10.0 GiB fixed). Lower UMRT_GPU_MEMORY or "
            "UMRT_SHARE_MIN, or set UMRT_SHARE_WAIT=SECONDS to wait for a share"], err
        # asked to wait, it starts once the share is free
        c = _job(tmp_path, UMRT_GPU_MEMORY="8GiB", UMRT_SHARE_WAIT="120")
        assert c.stderr.readline().startswith("umrt: waiting for a share of cuda:0: 18.0 GiB would be promised")
        a.close()
        assert _budget(c) == 8 * GiB
        c.kill()
        c.wait(timeout=60)
    finally:
        a.close()


# -- shadow mode: jobs on one simulated GPU ------------------------------------------------

SLEEPER = "import time\ntime.sleep(600)\n"


@pytest.mark.slow
def test_shadow_jobs_take_shares_of_their_simulated_gpu(tmp_path):
    """Two shadow runs on one simulated 80 GiB H100 (device 0): 50 GiB held, 40 GiB refused
    with exit status 2; killed, the first run's share lets a waiting one start."""
    (tmp_path / "sleep.py").write_text(SLEEPER)
    (tmp_path / "noop.py").write_text("print('ran')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMRT")}
    env.update(PYTHONPATH=str(ROOT), UMRT_SHARE_DIR=str(tmp_path / "shares"))
    run = [sys.executable, "-m", "umrt", "run", "--simulate", "h100-pcie5-80g"]
    a = subprocess.Popen([*run, "--gpu-memory", "50GiB", str(tmp_path / "sleep.py")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        registry = Registry(tmp_path / "shares", "sim-h100-pcie5-80g-0")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with registry.locked():
                held = [(m.pid, m.held) for m in registry.members()]
            if held:
                break
            time.sleep(0.2)
        assert held == [(a.pid, 50 * GiB)]
        b = subprocess.run([*run, "--gpu-memory", "40GiB", str(tmp_path / "noop.py")], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)  # refused before shadow mode loads
        assert b.returncode == 2 and "ran" not in b.stdout
        assert b.stderr.startswith("umrt: error: the simulated h100-pcie5-80g GPU 0 (80.0 GiB) cannot give this "
                                   "job its fixed 40.0 GiB"), b.stderr
        c = subprocess.Popen([*run, "--gpu-memory", "40GiB", str(tmp_path / "noop.py")], cwd=tmp_path,
                             env=dict(env, UMRT_SHARE_WAIT="300"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        assert c.stderr.readline().startswith("umrt: waiting for a share of the simulated h100-pcie5-80g GPU 0")
        a.send_signal(signal.SIGKILL)
        out, err = c.communicate(timeout=300)
        # it ran once a's share was free; a script with no training step has nothing to simulate (exit 2)
        assert "ran" in out and c.returncode == 2 and "the script made no optimizer step" in err, err
    finally:
        if a.poll() is None:
            a.kill()
        a.wait(timeout=60)


def test_shadow_runs_with_a_percentage_budget_take_no_share(tmp_path):
    """A percentage in shadow mode is of the footprint, unknown before the first iteration."""
    from umrt.config import from_env
    from umrt.shadow_ranks import simulated_share

    cfg = from_env({"UMRT_SIMULATE": "h100-pcie5-80g", "UMRT_GPU_MEMORY": "20%", "UMRT_SHARE_DIR": str(tmp_path)})
    with simulated_share(cfg, None) as held:
        assert held is None
    cfg = cfg.replace(gpu_memory="8GiB")
    with simulated_share(cfg, None) as held:
        assert held.held == 8 * GiB and held.total == 80 * GiB  # the profile's memory
    assert not list(Path(tmp_path).rglob("*.json"))  # left the registry


def test_share_settings_are_validated():
    from umrt.config import from_env
    from umrt.errors import ConfigError

    cfg = from_env({"UMRT_SHARE_WAIT": "forever", "UMRT_SHARE_MIN": "2GiB", "UMRT_SHARE_DIR": "off"})
    assert cfg.share_wait == math.inf and cfg.share_min.bytes == 2 * GiB and cfg.shares_off
    assert from_env({"UMRT_SHARE_WAIT": "30"}).share_wait == 30.0
    with pytest.raises(ConfigError, match="UMRT_SHARE_WAIT='soon' is not a wait"):
        from_env({"UMRT_SHARE_WAIT": "soon"})
    with pytest.raises(ConfigError, match="UMRT_SHARE_WAIT='-1' must be 0 or more"):
        from_env({"UMRT_SHARE_WAIT": "-1"})
    with pytest.raises(ConfigError, match="UMRT_SHARE_MIN"):
        from_env({"UMRT_SHARE_MIN": "lots"})


def test_the_default_registry_folder_is_memory_backed_where_there_is_one(monkeypatch):
    monkeypatch.undo()  # the real default_folder, not the tests' private one
    folder = share.default_folder()
    assert folder.name == "umrt-shares"
    if os.access("/dev/shm", os.W_OK):
        assert folder.parent == Path("/dev/shm")


def test_a_moved_share_reaches_the_live_runtime_at_a_step(fake_gpu, tmp_path):
    """move_share (an optimizer step's hook) hands a native steady state back to Python,
    then the runtime plans for the new budget and the pool populates within it."""
    from fake_cuda import FakeCupyRuntime

    import umrt.api as api
    from umrt.allocators.managed import ManagedPool
    from umrt.backends.cuda import CudaBackend, CupyApi
    from umrt.config import Config
    from umrt.drive.live import LiveBridge

    backend = CudaBackend(0, api=CupyApi(FakeCupyRuntime(fake_gpu)))
    registry = Registry(tmp_path, "cuda-0")
    mine = join(registry, fake_gpu.total, fixed=None, minimum=GiB)
    session = api.Session(Config(enabled=True), active=True, backend=backend, pool=ManagedPool(backend),
                          budget_bytes=mine.held, share=mine)
    bridge = session.runtime = LiveBridge(session, device="cpu")
    handed_back = []
    bridge.steady = type("Steady", (), {"catch_up": lambda self: handed_back.append(True)})()
    bridge.native = True
    assert api.move_share(session) is None  # nothing moved
    other = join(registry, fake_gpu.total, fixed=None, minimum=GiB)
    mine.poll()
    half = int(0.9 * fake_gpu.total / 2)
    assert api.move_share(session) == half
    assert handed_back == [True] and session.budget_bytes == half and session.pool.populate_limit == half
    assert bridge.policy.ctx.budget_bytes == half and bridge.failed is None
    other.close()
    mine.close()
