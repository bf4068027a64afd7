"""Code-shape figures of the ``umrt`` package: ``python -m bench.architecture``.

What a newcomer meets, counted from the source of ``umrt/`` and ``bench/`` (no import of either):

* the largest classes of both packages, by methods and by the attributes their methods
  set on ``self``;
* the largest files of both packages, and the lines of each package;
* the lines of the modules named on the command line (default: the facade and the runtime);
* ``getattr(obj, "name")`` / ``hasattr`` probes in ``umrt`` (duck typing where an interface should be);
* imports of umrt modules inside functions of ``umrt`` (hidden dependencies; a module that is
  optional or GPU-only says why with an ``# optional:`` comment on the import and is
  counted apart);
* import cycles between the modules of both packages: those the interpreter meets (every
  import outside ``if TYPE_CHECKING``) and those a reader meets (``TYPE_CHECKING`` imports too);
* private attributes one module reads or writes of another's: ``obj._name`` (``obj`` not
  ``self`` or ``cls``) where ``_name`` is defined only in other modules of the two packages,
  and ``from module import _name`` across modules;
* the typed ``Protocol``s of both packages and the classes that implement each: a class of
  either package or of ``tests/`` (a test's fake) that defines every member of it, itself or
  through its bases; a subclass of an implementer counts with it. A Protocol with at most one
  implementer is one where the class itself would do.

``tests/test_architecture.py`` holds the package to the limits these figures show.
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "umrt"
#: The packages whose imports, cycles and private reaches are counted together.
PACKAGES = (PACKAGE, ROOT / "bench")


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
    #: cycles once ``if TYPE_CHECKING`` imports count too (``cycles`` is a subset of these)
    cycles_with_type_checking: list[list[str]] = field(default_factory=list)
    #: ``file:line module-or-object._name``: another module's private attribute read or written
    private_reaches: list[str] = field(default_factory=list)
    #: ``a -> b`` for packages that import each other both ways (``umrt -> bench`` and back)
    package_cycles: list[str] = field(default_factory=list)
    #: lines of every file of both packages, largest first
    file_lines: dict[str, int] = field(default_factory=dict)
    #: lines of each package (``umrt``, ``bench``)
    package_lines: dict[str, int] = field(default_factory=dict)
    #: ``module.Protocol`` -> the classes that implement it (``module.Class``; ``tests.*``: a test's fake)
    protocols: dict[str, list[str]] = field(default_factory=dict)
    #: the Protocols with at most one implementer
    one_implementer_protocols: list[str] = field(default_factory=list)


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


def _imported(node: ast.AST, module: str, is_package: bool, tops: tuple[str, ...] = ("umrt",)) -> Iterator[str]:
    """The modules of ``tops`` an import statement names (``from a import b`` names ``a.b`` if it is a module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] in tops:
                yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            name = ".".join(base + ([node.module] if node.module else []))
        else:
            name = node.module or ""
        if name.split(".")[0] not in tops:
            return
        yield name
        for alias in node.names:
            yield f"{name}.{alias.name}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: attributes it stores on ``self`` or ``cls``, functions,
    classes and module- or class-level assignments."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _private(node.target.id):
            names.add(node.target.id)
    return names


def _root(node: ast.AST) -> str:
    """The name an attribute chain starts from (``a`` of ``a.b.c``), or ``""``."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _private_reaches(tree: ast.AST, rel: str, mod: str, is_package: bool, own: set[str],
                     elsewhere: dict[str, set[str]], tops: tuple[str, ...]) -> Iterator[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls`` (nor rooted in a third-party module,
    ``torch._C``) and only other modules define ``_name``; ``from other import _name``."""
    third_party = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom)) and not list(_imported(node, mod, is_package, tops))
                   and not getattr(node, "level", 0) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own \
                and node.attr in elsewhere and _root(node.value) not in third_party | {"self", "cls"}:
            yield f"{rel}:{node.lineno} {ast.unparse(node.value)}.{node.attr}"
        elif isinstance(node, ast.ImportFrom):
            names = list(_imported(node, mod, is_package, tops))
            if names:
                for alias in node.names:
                    if _private(alias.name):
                        yield f"{rel}:{node.lineno} {names[0]}.{alias.name}"


def measure(package: Path = PACKAGE, line_files: tuple[str, ...] = ("umrt/api.py", "umrt/policy/runtime/policy.py"),
            packages: tuple[Path, ...] = PACKAGES) -> Shape:
    """Every figure: probes and function-level imports of ``package``; classes, cycles,
    private reaches and lines across ``packages``."""
    shape = Shape()
    tops = tuple(p.name for p in packages)
    mods = {m: p for pkg in packages for m, p in modules(pkg).items()}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    reader_graph: dict[str, set[str]] = {m: set() for m in mods}
    trees = {mod: ast.parse(path.read_text()) for mod, path in mods.items()}
    defined = {mod: _defined_private_names(tree) for mod, tree in trees.items()}
    defined_by: dict[str, set[str]] = {}
    for mod, names in defined.items():
        for n in names:
            defined_by.setdefault(n, set()).add(mod)
    for mod, path in mods.items():
        source = path.read_text()
        tree = trees[mod]
        lines = source.splitlines()
        skip = _type_checking_nodes(tree)
        rel = path.relative_to(packages[tops.index(mod.split(".")[0])].parent).as_posix()
        is_package = path.name == "__init__.py"
        shape.file_lines[rel] = len(lines)
        top = mod.split(".")[0]
        shape.package_lines[top] = shape.package_lines.get(top, 0) + len(lines)
        shape.private_reaches.extend(_private_reaches(
            tree, rel, mod, is_package, defined[mod],
            {n: ms - {mod} for n, ms in defined_by.items() if ms - {mod}}, tops))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported(node, mod, is_package, tops):
                    if name in mods and name != mod:
                        reader_graph[mod].add(name)
                        if id(node) not in skip:
                            graph[mod].add(name)
        shape.classes.extend(_classes(tree, mod))
        if path.is_relative_to(package):
            _measure_package_module(shape, tree, lines, rel, mod, is_package, skip)
    shape.classes.sort(key=lambda c: (-c.methods, -c.attributes))
    shape.file_lines = dict(sorted(shape.file_lines.items(), key=lambda kv: -kv[1]))
    for f in line_files:
        p = package.parent / f
        if p.exists():
            shape.lines[f] = len(p.read_text().splitlines())
    shape.cycles = cycles(graph)
    shape.cycles_with_type_checking = cycles(reader_graph)
    between = {(a.split(".")[0], b.split(".")[0]) for a, deps in reader_graph.items() for b in deps}
    shape.package_cycles = sorted(f"{a} <-> {b}" for a, b in between if a < b and (b, a) in between)
    tests = package.parent / "tests"
    test_trees = {f"tests.{'.'.join(p.relative_to(tests).with_suffix('').parts)}": ast.parse(p.read_text())
                  for p in sorted(tests.rglob("*.py"))} if tests.is_dir() else {}
    shape.protocols = protocols(trees, test_trees)
    shape.one_implementer_protocols = sorted(p for p, imps in shape.protocols.items() if len(imps) <= 1)
    return shape


def _members(node: ast.ClassDef) -> set[str]:
    """What a class defines: its methods, its class-level names and what its methods set on ``self``."""
    names = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(n.name)
            names.update(t.attr for t in ast.walk(n) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                         and isinstance(t.value, ast.Name) and t.value.id == "self")
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for target in n.targets for t in ast.walk(target) if isinstance(t, ast.Name))
    return names


def protocols(trees: dict[str, ast.AST], test_trees: dict[str, ast.AST]) -> dict[str, list[str]]:
    """``module.Protocol`` -> its implementers, for each Protocol of ``trees``: the classes of
    ``trees`` and ``test_trees`` that define every member of it (themselves or through bases
    the modules name or import), a subclass of an implementer counted with it."""
    every = {**trees, **test_trees}
    short = {m.removeprefix("tests."): m for m in test_trees}  # tests import their siblings by name
    classes: dict[str, ast.ClassDef] = {}
    names: dict[str, dict[str, str | tuple[str, str]]] = {}  # module -> name -> class key or (module, name)
    for mod, tree in every.items():
        local = names.setdefault(mod, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                key = f"{mod}.{node.name}" + (f"@{node.lineno}" if f"{mod}.{node.name}" in classes else "")
                classes[key] = node
                local.setdefault(node.name, key)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    local.setdefault(alias.asname or alias.name, (short.get(node.module, node.module), alias.name))

    def resolve(mod: str, name: str, depth: int = 0) -> str:
        found = names.get(mod, {}).get(name, "")
        return resolve(*found, depth + 1) if isinstance(found, tuple) and depth < 8 else str(found)

    bases = {key: ["Protocol" if ast.unparse(b).split(".")[-1] == "Protocol" else resolve(key.rsplit(".", 1)[0], b.id)
                   if isinstance(b, ast.Name) else "" for b in node.bases] for key, node in classes.items()}
    is_protocol = {key for key, bs in bases.items() if "Protocol" in bs}

    def ancestors(key: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for b in bases[key]:
            if b in classes and b not in seen:
                out |= {b} | ancestors(b, seen | {key})
        return out

    members = {key: set(_members(node)).union(*(_members(classes[a]) for a in ancestors(key)))
               for key, node in classes.items()}
    out = {}
    for proto in sorted(k for k in is_protocol if k.split(".")[0] in {m.split(".")[0] for m in trees}):
        wanted = {m for m in members[proto] if not (m.startswith("__") and m.endswith("__"))}
        matching = {k for k in classes if k not in is_protocol and wanted <= members[k]}
        out[proto] = sorted(k for k in matching if not ancestors(k) & matching)
    return out


def _classes(tree: ast.AST, mod: str) -> Iterator[ClassShape]:
    """Each class of a module: its methods, and the attributes they set on ``self``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            attrs = {t.attr for m in methods for t in ast.walk(m)
                     if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                     and isinstance(t.value, ast.Name) and t.value.id == "self"}
            yield ClassShape(f"{mod}.{node.name}", len(methods), len(attrs))


def _measure_package_module(shape: Shape, tree: ast.AST, lines: list[str], rel: str, mod: str,
                            is_package: bool, skip: set[int]) -> None:
    """Getattr probes and function-level imports of one module of the main package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            shape.getattr_probes.append(f"{rel}:{node.lineno} {node.func.id} {node.args[1].value}")
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip \
                    and any(True for _ in _imported(node, mod, is_package)):
                where = f"{rel}:{node.lineno} {ast.unparse(node)}"
                optional = "optional:" in lines[node.lineno - 1] or "optional:" in lines[node.lineno - 2]
                (shape.optional_imports if optional else shape.function_imports).append(where)


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
    print(f"import cycles counting TYPE_CHECKING imports: {len(shape.cycles_with_type_checking)}"
          + "".join(f"\n  {' <-> '.join(c)}" for c in shape.cycles_with_type_checking))
    print(f"packages importing each other: {len(shape.package_cycles)}"
          + "".join(f"\n  {c}" for c in shape.package_cycles))
    by_file = Counter(r.split(":")[0] for r in shape.private_reaches)
    print(f"private attributes reached across modules: {len(shape.private_reaches)}"
          + (" (" + ", ".join(f"{f} {n}" for f, n in by_file.most_common()) + ")" if by_file else ""))
    print("largest files: " + ", ".join(f"{f} {n}" for f, n in list(shape.file_lines.items())[: args.top]))
    print("lines: " + ", ".join(f"{p} {n}" for p, n in shape.package_lines.items()))
    print(f"Protocols: {len(shape.protocols)}; with one implementer: {len(shape.one_implementer_protocols)}"
          + "".join(f"\n  {p} ({', '.join(shape.protocols[p]) or 'none'})" for p in shape.one_implementer_protocols))
    if args.verbose:
        for title, rows in (("probes", shape.getattr_probes), ("function-level imports", shape.function_imports),
                            ("optional imports", shape.optional_imports),
                            ("private attributes reached across modules", shape.private_reaches),
                            ("Protocols and their implementers",
                             [f"{p}: {', '.join(imps) or 'none'}" for p, imps in shape.protocols.items()])):
            print(f"\n{title}:")
            for r in rows:
                print("  " + r)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(shape), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
