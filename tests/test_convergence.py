"""A steady loop stays converged through what real training does (issue 10, item 5).

Real PyTorch training loops on the CPU, captured with the live path's recorder: an
evaluation pass every few steps (iterations of their own phase, learned and planned
apart), a short last batch, bf16 autocast. The runtime is fed closed loop as a live run
feeds it: launches only while it wants them. Each phase must reach acting without
launches and stay there: a new iteration shape is learned once (a deviation then),
never an endless alternation.
"""
from __future__ import annotations

import pytest
import torch

from bench.overhead import NullBackend
from umrt.capture import Recorder
from umrt.drive import Driver
from umrt.hardware import load_profile
from umrt.policy.base import PolicyContext
from umrt.policy.runtime import Runtime
from umrt.trace.events import IterationBoundary

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _capture(steps: int, *, eval_every: int = 0, short_last: bool = False, autocast: bool = False) -> list:
    """The events of a small GPT-2's training loop (AdamW foreach, dropout on)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64, use_cache=False)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    cap = Recorder(model, opt)
    with cap:
        for step in range(steps):
            model.train()
            batch = 1 if short_last and step == steps - 1 else 2
            tokens = torch.randint(0, 512, (batch, 32))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if eval_every and step % eval_every == eval_every - 1:
                model.eval()
                with torch.no_grad():
                    model(input_ids=torch.randint(0, 512, (2, 32)))
    return cap.events


def _drive(events: list) -> tuple[Runtime, dict[str, list[bool]]]:
    """Feed the runtime as a live run would: launches only while it wants them. Returns,
    for each loop phase, whether each of its iterations ran launch-free (in order)."""
    backend = NullBackend()
    rt = Runtime()
    layout = rt.make_layout(backend)
    rt.attach(PolicyContext(backend, layout, 64 << 20, load_profile("h100-sxm5-80g")))
    driver = Driver(rt, layout, backend, launches_on_demand=True)
    light: dict[str, list[bool]] = {}
    phase = None  # of the iteration running
    for ev in events:
        before = rt.report()["light_iterations"]
        driver.feed(ev)
        if type(ev) is IterationBoundary:
            if phase is not None:  # the boundary closes the iteration of ``phase``
                light.setdefault(phase, []).append(rt.report()["light_iterations"] > before)
            phase = ev.phase
    return rt, light


def _settled(flags: list[bool]) -> int:
    """The first launch-free iteration of a phase, after which every one is launch-free."""
    first = flags.index(True)
    assert all(flags[first:]), flags
    return first


@pytest.mark.parametrize("variation", [
    {"eval_every": 3},
    {"autocast": True},
    {"eval_every": 2, "autocast": True},
])
def test_a_real_training_loop_stays_launch_free(variation):
    steps = 21 if variation.get("eval_every") == 3 else 16  # 6 or 7 evaluations closed
    rt, light = _drive(_capture(steps, **variation))
    rep = rt.report()
    assert _settled(light["train"]) <= 6, (light, rep)
    if "eval_every" in variation:
        # an evaluation's phase is learned, then planned, on its own iterations
        assert _settled(light["eval"]) <= len(light["eval"]) - 2, (light, rep)
    assert rep["deviations"] <= 2 and rep["guard_trips"] == 0, rep


def test_a_short_last_batch_is_one_new_shape_not_a_relapse():
    rt, light = _drive(_capture(14, short_last=True))
    rep = rt.report()
    _settled(light["train"][:-1])  # the last, shorter iteration is a new shape
    assert rep["deviations"] <= 1 and rep["guard_trips"] == 0, rep
