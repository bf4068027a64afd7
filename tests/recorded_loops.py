"""Training loops recorded on the CPU for the tests that drive umrt over real event streams:
:func:`kfold` records one, :func:`drive` feeds a recording to a policy live."""
from __future__ import annotations

from umrt.capture.recorder import Recorder
from umrt.hardware import load_profile
from umrt.shadow import LiveRun, drive_live, refined_kinds
from umrt.sim.budget import resolve_budget


def kfold(folds: int, steps: int, width: int) -> Recorder:
    """K-fold training in one process: per fold a new MLP and AdamW, ``steps`` steps on a
    synthetic tabular set, the fold's validation under ``no_grad``, then both dropped."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    x = torch.randn(1536, 128)
    y = (x[:, :10].sum(1) > 0).long()
    rec = Recorder(steer=False)
    with rec:
        for _ in range(folds):
            model = torch.nn.Sequential(torch.nn.Linear(128, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                        torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
                                        torch.nn.Linear(width, 2))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            for _ in range(steps):
                idx = torch.randint(0, 1536, (128,))
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            model.eval()
            with torch.no_grad():  # the fold's validation
                (model(x[:512]).argmax(1) == y[:512]).float().mean().item()
            del model, opt
    return rec


def drive(rec: Recorder, gpu_memory: str = "50%", policy: str = "umrt") -> tuple[LiveRun, int]:
    """``policy`` driven live over the recording on the h100-pcie5-80g profile with ``gpu_memory``
    of its footprint, as shadow mode runs it: the run (checked error-free) and the budget in bytes."""
    tr = rec.trace()
    budget = resolve_budget(gpu_memory, tr).bytes
    run = drive_live(list(rec.events), policy, load_profile("h100-pcie5-80g"), budget, refined_kinds(tr))
    assert run.error is None
    return run, budget
