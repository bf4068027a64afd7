"""The bench grid: models x budgets x profiles x policies, simulated cell by cell.

Traces are made on the fly on the meta device (``umrt.zoo.trace_model``), in
each of the grid's training precisions (``dtypes``), and cached under
``bench/.cache/`` (``umrt.trace.fileformat``); every cell is one
``umrt.sim.replay.simulate`` call. A cell that fails (a policy that cannot be imported,
a :class:`~umrt.errors.DataIntegrityError`) is recorded with its error and
the run goes on.

A budget is the GPU memory of a cell: a percentage of the footprint the run
needs (``20%``, :mod:`umrt.sim.budget`: 100% holds everything), of the trace's
peak live bytes (``20%peak``), or a size (``8GiB``); every row carries its
bytes and its share of both.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from umrt.config import SIMULATED_FORMS, Amount, read_amount, simulated_amount
from umrt.errors import ConfigError

__all__ = ["Cell", "Grid", "PRESETS", "preset", "parse_budget", "check_budget", "run_grid", "trace_for", "cell_bound", "CACHE_DIR",
           "DTYPES", "BUDGET_KEYS"]

CACHE_DIR = Path(__file__).resolve().parent / ".cache"
PAPER_PROFILES = ("v100-pcie3-32g", "h100-pcie5-80g")
TARGET_MODELS = ("gpt2-xl", "bert-large", "vit-large", "resnet-152")
PEERS = ("deepum", "sentinel", "vdnn", "swapadvisor")
DTYPES = ("float32", "bfloat16", "float16")  # as `umrt trace --dtype`
# What every row says about its budget (umrt.sim.budget.Budget.to_json, plus its sentence).
BUDGET_KEYS = ("budget_text", "budget_base", "needed_footprint_bytes", "pool_footprint_bytes",
               "caching_footprint_bytes", "budget_of_footprint", "budget_of_peak", "budget_description")


@dataclass(frozen=True)
class Grid:
    """What to run. ``batch``/``seq`` override the zoo's defaults per model (None = default);
    ``dtypes`` are training precisions; ``budget_base`` is what a budget percentage is of."""

    models: tuple[str, ...]
    budgets: tuple[str, ...]
    profiles: tuple[str, ...]
    policies: tuple[str, ...]
    batch: dict[str, int] = field(default_factory=dict)
    seq: dict[str, int] = field(default_factory=dict)
    iterations: int = 3
    dtypes: tuple[str, ...] = ("float32",)
    budget_base: str = "footprint"

    def cells(self) -> list[Cell]:
        # Models outermost so each trace is made (or loaded) once; "ideal" first
        # within a model so the reference exists when the others are read.
        order = sorted(self.policies, key=lambda p: (p != "ideal", self.policies.index(p)))
        return [
            Cell(m, self.batch.get(m), self.seq.get(m), prof, b, pol, dtype, self.budget_base)
            for m in self.models
            for dtype in self.dtypes
            for prof in self.profiles
            for b in self.budgets
            for pol in order
        ]


@dataclass(frozen=True)
class Cell:
    model: str
    batch: int | None
    seq: int | None
    profile: str
    budget: str
    policy: str
    dtype: str = "float32"
    budget_base: str = "footprint"


# The default grid must finish within 5 minutes on a 2-core machine: GPT-2
# and BERT base at the zoo's paper-like batch sizes, two budgets, both paper
# profiles (about 2 minutes with cold trace caches).
PRESETS: dict[str, Grid] = {
    "default": Grid(
        models=("gpt2", "bert-base"),
        budgets=("20%", "50%"),
        profiles=PAPER_PROFILES,
        policies=("ideal", "um", "um-advise", "oracle", "umrt"),
    ),
    # The README's first table (issue 3), in fp32 and in bf16 (issue 11: users train in bf16).
    "readme": Grid(
        models=TARGET_MODELS,
        budgets=("20%", "50%"),
        profiles=PAPER_PROFILES,
        policies=("ideal", "um", "um-advise", "oracle"),
        dtypes=("float32", "bfloat16"),
    ),
    # Issue 4's targets, everything side by side in one run.
    "targets": Grid(
        models=TARGET_MODELS,
        budgets=("20%",),
        profiles=PAPER_PROFILES,
        policies=("ideal", "um", "oracle", "umrt") + PEERS,
    ),
}


def preset(name: str) -> Grid:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown bench preset {name!r}; valid: {', '.join(PRESETS)}") from None


def check_budget(text: str) -> Amount:
    """A bench budget (GPU memory of a cell), checked: a percentage of the footprint the run needs
    (``20%``) or of its peak live bytes (``20%peak``), or a size (``8GiB``); read by
    :func:`umrt.config.read_amount`, as every memory amount umrt takes."""
    amount = read_amount(str(text))
    if amount is None:
        raise ConfigError(f"invalid budget {text!r}: give {SIMULATED_FORMS}")
    if amount.fraction is not None:
        simulated_amount(amount)
        if not 0 < amount.fraction < math.inf:
            raise ConfigError(f"budget {text!r} must be above 0%")
    elif not amount.bytes:
        raise ConfigError(f"budget {text!r} must be more than zero bytes")
    return amount


def parse_budget(text: str) -> float:
    """A percentage bench budget, ``"20%"`` or ``"20%peak"``, as a fraction of its base (:func:`check_budget`);
    a size is a :class:`ConfigError` here."""
    amount = check_budget(text)
    if amount.fraction is None:
        raise ConfigError(f"budget {text!r} is a size, not a percentage")
    return amount.fraction


def check_dtype(dtype: str) -> str:
    """``dtype`` if it is a training precision the zoo traces in, else a ConfigError."""
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return dtype


def trace_for(model: str, batch: int | None, seq: int | None, *, cache_dir: Path = CACHE_DIR,
              steps: int = 3, refresh: bool = False, dtype: str = "float32"):
    """The model's training trace on meta, from the cache or made now (and cached)."""
    from umrt import __version__
    from umrt.trace import fileformat

    batch, seq = resolved_shape(model, batch, seq)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
    # The format version is in the key: a trace made before launches carried
    # their precision (format 1) is made again, not simulated at the wrong peak.
    path = cache_dir / (f"{safe}-b{batch}-s{seq}-steps{steps}-v{__version__}"
                        f"{'' if dtype == 'float32' else '-' + dtype}-f{fileformat.FORMAT_VERSION}.umrt")
    if path.exists() and not refresh:
        return fileformat.load(path)
    from umrt.zoo import trace_model

    trace = trace_model(model, batch=batch, seq=seq, device="meta", steps=steps, progress=False, dtype=dtype)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fileformat.save(trace, tmp)
    tmp.replace(path)  # atomic: an interrupted run never leaves a half-written cache entry
    return trace


def resolved_shape(model: str, batch: int | None, seq: int | None) -> tuple[int, int]:
    """Batch and sequence length with the model's defaults filled in (so the cache key names them).

    The defaults are the zoo's own (:func:`umrt.zoo.resolve`), as ``trace_model`` would pick them: an
    ``hf:`` model's sequence is capped by its position embeddings, a vision model's is its image size.
    """
    from umrt.zoo import resolve

    if batch is None or seq is None:
        spec = resolve(model)
        batch = spec.default_batch if batch is None else batch
        seq = spec.default_seq if seq is None else seq
    return batch, seq


def _simulate(trace, policy, profile, budget, iterations, budget_base="footprint"):
    from umrt.sim.replay import simulate

    return simulate(trace, policy, profile, budget, iterations=iterations, progress=False, budget_base=budget_base)


def budget_fields(trace, budget: str, base: str) -> dict:
    """What ``budget`` is for ``trace``: its bytes, both bases and its sentence (empty if it cannot say)."""
    from umrt.sim.budget import resolve_budget

    try:
        b = resolve_budget(budget, trace, base)
    except Exception:  # noqa: BLE001 - a trace without objects has no footprint; the cell reports its own error
        return {}
    return {"budget_bytes": b.bytes, "peak_live_bytes": b.needs.peak_live_bytes, **b.to_json(),
            "budget_description": b.describe()}


def run_cell(cell: Cell, trace, profile, iterations: int, simulate: Callable = _simulate) -> dict:
    """Simulate one cell; a failure is returned as the cell's ``error``, not raised."""
    from umrt.policy import make_policy

    row: dict = asdict(cell)
    header_meta = getattr(getattr(trace, "header", None), "meta", {}) or {}
    row["batch"] = cell.batch if cell.batch is not None else header_meta.get("batch")
    row["seq"] = cell.seq if cell.seq is not None else header_meta.get("seq")
    row |= budget_fields(trace, cell.budget, cell.budget_base)
    start = time.perf_counter()
    try:
        policy = make_policy(cell.policy, trace=trace)
        # Each policy in its steady state: a runtime that learns needs more iterations.
        iterations = policy.steady_iterations(at_least=iterations)
        row["iterations"] = iterations
        result = simulate(trace, policy, profile, cell.budget, iterations, budget_base=cell.budget_base)
        data = result.to_json() if hasattr(result, "to_json") else dict(result)
    except Exception as exc:  # noqa: BLE001 - one bad cell must not end the run
        row.update(error=f"{type(exc).__name__}: {exc}", sim_wall_s=round(time.perf_counter() - start, 3))
        return row
    wall = time.perf_counter() - start
    for key in ("iteration_time_s", "ideal_time_s", "h2d_bytes", "d2h_bytes", "faults", "fault_batches",
                "evictions", "peak_resident_bytes", "budget_bytes", "peak_live_bytes", "footprint_bytes",
                "page_events", "iteration_times_s", *BUDGET_KEYS):
        if key in data:
            row[key] = data[key]
    if "breakdown" in data:
        row["breakdown"] = data["breakdown"]
    if policy_report := getattr(policy, "report", None):
        try:
            row["policy_report"] = policy_report()
        except Exception:  # noqa: BLE001 - a report is optional decoration
            pass
    row["sim_wall_s"] = round(wall, 3)  # the whole cell: policy set-up (oracle planning) included
    # The simulator's own throughput when it reports it (its wall time covers
    # the replay only), else page events over the cell's wall time.
    rate = data.get("page_events_per_s")
    events = data.get("page_events")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate)):
        rate = events / wall if events and wall > 0 else None
    row["page_events_per_s"] = round(rate, 1) if rate is not None else None
    row["error"] = None
    return row


def cell_bound(trace, profile, budget: str, iterations: int, budget_base: str = "footprint") -> dict:
    """The link bound of one cell (:func:`umrt.sim.bound.link_bound`) as row fields.

    ``bound_time_s``: no policy's steady iteration is shorter in the simulator;
    ``bound_conserving_s``: the same if every crossing of the link were charged
    to it. Both None (and ``bound_error`` set) when it cannot be computed.
    """
    from umrt.sim.bound import link_bound

    try:
        b = link_bound(trace, profile, budget, iterations=iterations, budget_base=budget_base)
    except Exception as exc:  # noqa: BLE001 - a missing bound must not cost the cell its result
        return {"bound_time_s": None, "bound_conserving_s": None, "bound_error": f"{type(exc).__name__}: {exc}"}
    return {"bound_time_s": b.time_s, "bound_conserving_s": b.conserving_s}


def run_grid(grid: Grid, *, progress: bool = True, cache_dir: Path = CACHE_DIR,
             trace_fn: Callable | None = None, simulate: Callable = _simulate,
             on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every cell of ``grid``; returns one row (dict) per cell, in grid order.

    ``trace_fn(model, batch, seq, dtype)`` makes (or loads) a cell's trace.
    """
    from umrt.hardware import load_profile
    from umrt.sim.budget import BASES

    for b in grid.budgets:
        check_budget(b)
    for d in grid.dtypes:
        check_dtype(d)
    if grid.budget_base not in BASES:
        raise ConfigError(f"unknown budget base {grid.budget_base!r}; valid: {', '.join(BASES)}")
    profiles = {name: load_profile(name) for name in grid.profiles}  # bad names fail before any work
    cells = grid.cells()
    traces: dict[tuple, object] = {}
    bounds: dict[tuple, dict] = {}  # one link bound per (model, shape, dtype, profile, budget), shared by its policies
    rows: list[dict] = []
    make_trace = trace_fn or (lambda m, b, s, d: trace_for(m, b, s, cache_dir=cache_dir, dtype=d))

    with _progress(progress) as bar:
        task = bar.add_task("bench", total=len(cells)) if bar else None
        for cell in cells:
            key = (cell.model, cell.batch, cell.seq, cell.dtype)
            if bar:
                dtype = "" if cell.dtype == "float32" else f" {cell.dtype}"
                bar.update(task, description=f"{cell.model}{dtype} {cell.profile} {cell.budget} {cell.policy}")
            if key not in traces:
                try:
                    traces[key] = make_trace(*key)
                except Exception as exc:  # noqa: BLE001 - the model's cells all report it
                    traces[key] = exc
            trace = traces[key]
            if isinstance(trace, Exception):
                row = asdict(cell) | {"error": f"trace failed: {type(trace).__name__}: {trace}"}
                row |= {"bound_time_s": None, "bound_conserving_s": None}
            else:
                row = run_cell(cell, trace, profiles[cell.profile], grid.iterations, simulate)
                where = key + (cell.profile, cell.budget)
                if where not in bounds:
                    bounds[where] = cell_bound(trace, profiles[cell.profile], cell.budget, grid.iterations,
                                               cell.budget_base)
                row |= bounds[where]
            rows.append(row)
            if on_row:
                on_row(row)
            if bar:
                bar.advance(task)
    derive(rows)
    return rows


def derive(rows: list[dict]) -> None:
    """Add slowdown vs ideal and speedup vs um to every successful row."""
    um = {cell_group(r): r.get("iteration_time_s") for r in rows if r["policy"] == "um" and not r.get("error")}
    for r in rows:
        t, ideal = r.get("iteration_time_s"), r.get("ideal_time_s")
        r["slowdown_vs_ideal"] = round(t / ideal, 4) if t and ideal else None
        base = um.get(cell_group(r))
        r["speedup_vs_um"] = round(base / t, 4) if t and base else None


def cell_group(row: dict) -> tuple:
    """What a row's policies are compared over: model, shape, profile, budget, precision and budget base."""
    return (row["model"], row.get("batch"), row.get("seq"), row["profile"], row["budget"], dtype_of(row),
            base_of(row))


def dtype_of(row: dict) -> str:
    """A row's training precision (rows written before the bench had dtypes are float32)."""
    return row.get("dtype") or "float32"


def base_of(row: dict) -> str:
    """What a row's budget percentage is of (rows written before the footprint base: peak live bytes)."""
    return row.get("budget_base") or "peak"


def _progress(enabled: bool):
    """Progress: a rich bar on a terminal, one line per finished cell elsewhere (a log, a pipe),
    nothing when disabled (the context yields None)."""
    if not enabled:
        return contextlib.nullcontext()
    if not sys.stderr.isatty():
        return contextlib.nullcontext(LineProgress())
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=False)


class LineProgress:
    """The part of rich's ``Progress`` the grid uses, printing one line to stderr per finished cell:
    ``bench: [3/16] gpt2 v100-pcie3-32g 20% um (41 s)``."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._tasks: dict[int, list] = {}  # task -> [description, done, total]

    def add_task(self, description: str, total: int) -> int:
        self._tasks[len(self._tasks)] = [description, 0, total]
        return len(self._tasks) - 1

    def update(self, task: int, description: str) -> None:
        self._tasks[task][0] = description

    def advance(self, task: int) -> None:
        t = self._tasks[task]
        t[1] += 1
        print(f"bench: [{t[1]}/{t[2]}] {t[0]} ({time.perf_counter() - self._start:.0f} s)", file=sys.stderr,
              flush=True)


def geomean(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def split_list(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"a,b c"`` -> ``("a", "b", "c")``; an ``hf:Config:k=v,k=v`` model spec stays whole."""
    parts = text if not isinstance(text, str) else [text]
    out: list[str] = []
    for token in (t for chunk in parts for t in chunk.split()):
        out.extend([token] if token.startswith("hf:") else [t for t in token.split(",") if t])
    return tuple(out)
