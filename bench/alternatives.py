"""What users pick instead: umrt beside activation checkpointing, ``python -m bench.alternatives``.

When a model does not fit, a PyTorch user's usual answer is activation
checkpointing (recompute the forward's activations in backward). Measured on an
H100 80GB HBM3 (``../shared/gpu-evidence/alternatives.jsonl``, h100-measured.md
section 5): GPT-2 small 8 x 1024 fp32 ran at 1.27x plain PyTorch's step with its
peak at 45% of plain's, BERT-large 32 x 512 fp32 at 1.31x with 33%.

The table simulates umrt on ``h100-sxm5-80g`` (SIMULATED) for both models, fp32
and bf16, at the memory checkpointing needed (45% / 33% of the trace's peak live
bytes: ``--budget-base peak``) and at 25%, where checkpointing cannot go (its own
peak is above it). Each row: umrt's step over the ideal step (unlimited memory),
with its SM copies (the default) and with the copy engines (``UMRT_SWAP_COPY=engines``),
the link bound (:mod:`umrt.sim.bound`'s ``steady_s``: no policy's steady step is
shorter in the simulator) over ideal, umrt over the bound, and checkpointing's MEASURED figure
beside them (fp32, at its own peak only: it was not measured in bf16). Where the
bound itself is above checkpointing's figure, the row says so: moving data over
the link cannot match recomputation there, and the two figures tell by how much.

Traces are the bench grid's meta traces (:func:`bench.grid.trace_for`, cached).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["CHECKPOINTING", "Row", "budget_percent", "main", "rows", "table"]

PROFILE = "h100-sxm5-80g"
MODELS = (("gpt2", 8, 1024), ("bert-large", 32, 512))
DTYPES = ("float32", "bfloat16")
TIGHT = "25%"  # below checkpointing's own peak for both models
# Measured on an H100 80GB HBM3 (alternatives.jsonl): activation checkpointing's steady step
# over plain PyTorch's, and its peak allocated bytes over plain's (fp32).
CHECKPOINTING = {
    "gpt2": {"step_ratio": 235.0645489999863 / 185.46572199999645, "peak_fraction": 6864139264 / 15173841920,
             "budget": "45%"},
    "bert-large": {"step_ratio": 1065.0574039999867 / 812.081274999997, "peak_fraction": 12057632256 / 37052538368,
                   "budget": "33%"},
}
SOURCE = "../shared/gpu-evidence/alternatives.jsonl (H100 80GB HBM3, torch 2.11, fp32)"


@dataclass
class Row:
    """One cell: a model, a precision and a budget (a percentage of the trace's peak live bytes)."""

    model: str
    batch: int
    seq: int
    dtype: str
    budget: str
    ideal_s: float  # SIMULATED
    umrt_s: float  # SIMULATED, umrt's default swap copies (SM copies: assumed rates, MODEL.md)
    bound_s: float  # SIMULATED
    checkpointing: float | None  # MEASURED step ratio, fp32 at its own peak; None elsewhere
    out_gb: float = 0.0  # SIMULATED: bytes that left the GPU in the steady step (copies, migrations)
    in_gb: float = 0.0
    error: str = ""
    engines_s: float = float("nan")  # SIMULATED, UMRT_SWAP_COPY=engines (the H200's measured copies)

    @property
    def umrt_ratio(self) -> float:
        return self.umrt_s / self.ideal_s

    @property
    def engines_ratio(self) -> float:
        return self.engines_s / self.ideal_s

    @property
    def bound_ratio(self) -> float:
        return self.bound_s / self.ideal_s

    @property
    def to_bound(self) -> float:
        return self.umrt_s / self.bound_s

    @property
    def bound_above_checkpointing(self) -> bool:
        return self.checkpointing is not None and self.bound_ratio > self.checkpointing

    def to_json(self) -> dict:
        return asdict(self) | {"umrt_over_ideal": self.umrt_ratio, "engines_over_ideal": self.engines_ratio,
                               "bound_over_ideal": self.bound_ratio,
                               "umrt_over_bound": self.to_bound,
                               "bound_above_checkpointing": self.bound_above_checkpointing}


def budget_percent(text: str) -> float:
    """A budget as ``N%`` of the trace's peak live bytes, 0 < N <= 100; ValueError otherwise."""
    try:
        value = float(text[:-1]) if text.endswith("%") else float("nan")
    except ValueError:
        value = float("nan")
    if not 0 < value <= 100:
        raise ValueError(f"a budget here is a percentage of the trace's peak live bytes, such as 45%: got {text!r}")
    return value


def _budget_arg(text: str) -> str:
    """``--budgets``' type: the text itself, once :func:`budget_percent` accepts it."""
    try:
        return budget_percent(text) and text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def rows(models=MODELS, dtypes=DTYPES, profile: str = PROFILE, progress: bool = True,
         budgets: tuple[str, ...] | None = None) -> list[Row]:
    """Every cell, simulated (each umrt run to its steady state, as ``umrt simulate`` reports it);
    ``budgets``: percentages of the trace's peak (default: checkpointing's own peak and 25%)."""
    from bench.grid import trace_for
    from umrt.errors import UmrtError
    from umrt.policy import make_policy
    from umrt.sim.bound import link_bound
    from umrt.sim.replay import simulate

    out: list[Row] = []
    for model, batch, seq in models:
        for dtype in dtypes:
            trace = trace_for(model, batch, seq, dtype=dtype)
            ideal = simulate(trace, "ideal", profile, "100%", budget_base="peak").iteration_time_s
            ckpt = CHECKPOINTING[model]
            for budget in budgets or (ckpt["budget"], TIGHT):
                t0 = time.perf_counter()
                at_peak = dtype == "float32" and budget_percent(budget) == budget_percent(ckpt["budget"])
                measured = ckpt["step_ratio"] if at_peak else None
                try:
                    steps = make_policy("umrt", trace).steady_iterations()
                    r, engines = (simulate(trace, make_policy("umrt", trace), profile, budget, iterations=steps,
                                           budget_base="peak", swap_copy=copies) for copies in ("sm", "engines"))
                    b = link_bound(trace, profile, budget, iterations=steps, budget_base="peak")
                    bound = b.steady_s if r.iteration_times_s[-2] <= r.iteration_time_s * (1 + 1e-9) else b.time_s
                    row = Row(model, batch, seq, dtype, budget, ideal, r.iteration_time_s, bound, measured,
                              r.d2h_bytes / 1e9, r.h2d_bytes / 1e9, engines_s=engines.iteration_time_s)
                except UmrtError as exc:
                    row = Row(model, batch, seq, dtype, budget, ideal, float("nan"), float("nan"), measured,
                              error=str(exc))
                out.append(row)
                if progress:
                    print(f"  {model} {dtype} {budget}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def table(cells: list[Row]) -> str:
    """The rows as a markdown table (SIMULATED and MEASURED columns labelled)."""
    out = [f"What users pick instead, on {PROFILE}: umrt and the link bound SIMULATED, activation "
           f"checkpointing MEASURED ({SOURCE}). Budgets are % of the trace's peak live bytes.", "",
           "| model | dtype | budget | umrt / ideal (SIMULATED) | umrt, copy engines / ideal (SIMULATED) | "
           "bound / ideal (SIMULATED) | umrt / bound | checkpointing / plain (MEASURED) | note |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in cells:
        if r.error:
            out.append(f"| {r.model} {r.batch}x{r.seq} | {r.dtype} | {r.budget} | - | - | - | - | - | {r.error} |")
            continue
        ck = f"{r.checkpointing:.2f}x" if r.checkpointing is not None else "-"
        if r.bound_above_checkpointing:
            note = (f"the bound is above checkpointing: moving data cannot match recomputation here "
                    f"(by {r.bound_ratio / r.checkpointing:.2f}x at best)")
        elif budget_percent(r.budget) < budget_percent(CHECKPOINTING[r.model]["budget"]):
            note = "below checkpointing's own peak"
        else:
            note = ""
        out.append(f"| {r.model} {r.batch}x{r.seq} | {r.dtype} | {r.budget} | {r.umrt_ratio:.2f}x | "
                   f"{r.engines_ratio:.2f}x | {r.bound_ratio:.2f}x | {r.to_bound:.2f} | {ck} | {note} |")
    out += ["", "umrt copies swapped memory with its SM copy kernel (UMRT_SWAP_COPY=sm, the default), whose rate "
            "and overlap with compute are assumed, not measured (umrt/sim/MODEL.md, \"SM copies\"); the copy "
            "engines' column takes the H200's measurement (nothing runs beside such a copy)."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.alternatives", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--models", nargs="+", choices=[m for m, _, _ in MODELS], help="a subset of the models")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, help="a subset of the precisions")
    parser.add_argument("--budgets", nargs="+", metavar="N%", type=_budget_arg,
                        help="budgets as %% of the trace's peak live bytes (default: checkpointing's own peak "
                             f"for each model, and {TIGHT.replace('%', '%%')})")
    args = parser.parse_args(argv)
    models = [m for m in MODELS if not args.models or m[0] in args.models]
    cells = rows(models, tuple(args.dtype or DTYPES), budgets=tuple(args.budgets) if args.budgets else None)
    print(table(cells))
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in cells], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
