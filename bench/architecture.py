"""Code-shape figures of the ``umrt`` package: ``python -m bench.architecture``.

What a newcomer meets, counted from the source (no import of umrt):

* the largest classes, by methods and by the attributes their methods set on ``self``;
* the lines of the modules named on the command line (default: the facade and the runtime);
* ``getattr(obj, "name")`` / ``hasattr`` probes (duck typing where an interface should be);
* imports of umrt modules inside functions (hidden dependencies; a module that is
  optional or GPU-only says why with an ``# optional:`` comment on the import and is
  counted apart);
* import cycles between umrt modules (every import outside ``if TYPE_CHECKING``).

``tests/test_architecture.py`` holds the package to the limits these figures show.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "umrt"


@dataclass
class ClassShape:
    name: str
    methods: int
    attributes: int


@dataclass
class Shape:
    classes: list[ClassShape] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)
    getattr_probes: list[str] = field(default_factory=list)
    function_imports: list[str] = field(default_factory=list)
    optional_imports: list[str] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(node):
                skip.add(id(sub))
    return skip


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """The umrt modules an import statement names (``from a import b`` names ``a.b`` if it is a module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "umrt":
                yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        if name.split(".")[0] != "umrt":
            return
        yield name
        for alias in node.names:
            yield f"{name}.{alias.name}"


def measure(package: Path = PACKAGE, line_files: tuple[str, ...] = ("umrt/api.py", "umrt/policy/runtime/policy.py")) -> Shape:
    shape = Shape()
    mods = modules(package)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        source = path.read_text()
        tree = ast.parse(source)
        lines = source.splitlines()
        skip = _type_checking_nodes(tree)
        rel = path.relative_to(package.parent).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                attrs = {t.attr for m in methods for t in ast.walk(m)
                         if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                         and isinstance(t.value, ast.Name) and t.value.id == "self"}
                shape.classes.append(ClassShape(f"{mod}.{node.name}", len(methods), len(attrs)))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                shape.getattr_probes.append(f"{rel}:{node.lineno} {node.func.id} {node.args[1].value}")
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip \
                        and any(True for _ in _imported(node, mod, path.name == "__init__.py")):
                    where = f"{rel}:{node.lineno} {ast.unparse(node)}"
                    optional = "optional:" in lines[node.lineno - 1] or "optional:" in lines[node.lineno - 2]
                    (shape.optional_imports if optional else shape.function_imports).append(where)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                for name in _imported(node, mod, path.name == "__init__.py"):
                    if name in mods and name != mod:
                        graph[mod].add(name)
    shape.classes.sort(key=lambda c: (-c.methods, -c.attributes))
    for f in line_files:
        p = package.parent / f
        if p.exists():
            shape.lines[f] = len(p.read_text().splitlines())
    shape.cycles = cycles(graph)
    return shape


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted.

    A package's ``__init__`` importing its own submodules is not a cycle of
    dependencies (a submodule importing its package's ``__init__`` is then
    one), so edges from a package to its own submodules are left out."""
    graph = {m: {n for n in deps if not n.startswith(m + ".")} for m, deps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.architecture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", nargs="*", default=["umrt/api.py", "umrt/policy/runtime/policy.py"],
                    help="files whose line counts are shown (paths from the repository root)")
    ap.add_argument("--top", type=int, default=8, help="largest classes shown")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("-v", "--verbose", action="store_true", help="list each probe and function-level import")
    args = ap.parse_args(argv)
    shape = measure(line_files=tuple(args.lines))
    print("largest classes (methods, attributes set on self):")
    for c in shape.classes[: args.top]:
        print(f"  {c.methods:3d} {c.attributes:3d}  {c.name}")
    for f, n in shape.lines.items():
        print(f"lines {f}: {n}")
    print(f"getattr/hasattr probes with a literal name: {len(shape.getattr_probes)}")
    print(f"umrt imports inside functions: {len(shape.function_imports)} "
          f"(+ {len(shape.optional_imports)} marked optional)")
    print(f"import cycles: {len(shape.cycles)}" + "".join(f"\n  {' <-> '.join(c)}" for c in shape.cycles))
    if args.verbose:
        for title, rows in (("probes", shape.getattr_probes), ("function-level imports", shape.function_imports),
                            ("optional imports", shape.optional_imports)):
            print(f"\n{title}:")
            for r in rows:
                print("  " + r)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(shape), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
