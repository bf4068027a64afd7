"""torchrun on a real GPU (marked ``gpu``; skipped without one): umrt in every rank.

* one rank over NCCL with ``UMRT=1``: GPT-2's losses those of the same job without umrt;
* two ranks on the one GPU (gloo on CUDA tensors), each under umrt: both in the GPU's
  share registry at once, their shares never more than the device together, losses
  those of the plain job.

Each rank runs ``examples/train_ddp.py`` through a wrapper that prints, at the end, what
umrt did in that rank (active, device, budget, the device's memory).
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_ddp.py"
STEPS = 8

WRAPPER = textwrap.dedent("""
    import json, os, runpy, sys
    example, args = sys.argv[1], sys.argv[2:]
    sys.argv = [example, *args]
    try:
        runpy.run_path(example, run_name="__main__")
    except SystemExit as exc:
        assert not exc.code, exc.code
    import umrt.api, umrt.stats
    s = umrt.api.current()
    print("UMRT", json.dumps({"rank": int(os.environ["RANK"]), "active": bool(s and s.active),
                              "device": s.config.device if s else None, "budget": s.budget_bytes if s else 0,
                              "total": s.backend.mem_info()[1] if s and s.active else 0,
                              "stats": umrt.stats.memory_stats()}, default=str), flush=True)
""")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UMRT")}
    env.update(PYTHONPATH=str(ROOT), CUBLAS_WORKSPACE_CONFIG=":4096:8", UMRT_SHARE_DIR=str(tmp_path / "shares"),
               **extra)
    return env


def _torchrun(tmp_path: Path, ranks: int, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            str(wrapper), str(EXAMPLE), "--device", "cuda", "--steps", str(STEPS), "--layers", "4",
            "--hidden", "256", "--batch", "4", "--seq", "128", *args]
    out = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def _losses(stdout: str) -> dict[tuple[int, int], float]:
    return {(int(r), int(s)): float(v) for r, s, v in re.findall(r"rank (\d+) step (\d+): loss (\S+)", stdout)}


def _umrt(stdout: str) -> dict[int, dict]:
    found = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("UMRT ")]
    return {d["rank"]: d for d in found}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-5) for k in a)


def test_one_rank_over_nccl_under_umrt_trains_as_without(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "umrt").mkdir()
    plain = _torchrun(tmp_path / "plain", 1, _env(tmp_path))
    under = _torchrun(tmp_path / "umrt", 1, _env(tmp_path, UMRT="1"))
    assert len(_losses(plain.stdout)) == STEPS and _same(_losses(under.stdout), _losses(plain.stdout))
    rank0 = _umrt(under.stdout)[0]
    assert rank0["active"] and rank0["device"] == 0, rank0
    assert rank0["budget"] == int(0.9 * rank0["total"])  # alone on the GPU: a fair share of 90%
    assert rank0["stats"]["acting"] or rank0["stats"]["stopped_reason"] is None, rank0["stats"]
    assert not _umrt(plain.stdout)[0]["active"]


def test_two_ranks_on_one_gpu_each_under_umrt_stay_within_it(tmp_path):
    """gloo over CUDA tensors, both ranks on GPU 0: each joins the GPU's share registry; the
    registry, read while they train, never holds more than the device."""
    from umrt.share import Registry

    env = _env(tmp_path, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    (tmp_path / "plain").mkdir()
    (tmp_path / "umrt").mkdir()
    plain = _torchrun(tmp_path / "plain", 2, env, "--backend", "gloo")

    seen: list[tuple[int, int]] = []  # (members, bytes held) at each look
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            folder = tmp_path / "shares"
            for sub in folder.glob("*") if folder.is_dir() else ():
                registry = Registry(folder, sub.name)
                with registry.locked():
                    members = registry.members()
                if members:
                    seen.append((len(members), sum(m.held for m in members)))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        under = _torchrun(tmp_path / "umrt", 2, dict(env, UMRT="1"), "--backend", "gloo")
    finally:
        done.set()
        watcher.join(timeout=30)
    assert _same(_losses(under.stdout), _losses(plain.stdout)) and len(_losses(plain.stdout)) == 2 * STEPS
    ranks = _umrt(under.stdout)
    assert set(ranks) == {0, 1} and all(r["active"] and r["device"] == 0 for r in ranks.values()), ranks
    total = ranks[0]["total"]
    assert any(n == 2 for n, _ in seen), seen  # both ranks were in the registry at once
    assert all(held <= total for _, held in seen), (seen, total)  # never more than the device
    assert "is shared with 1 other umrt job(s)" in under.stderr
