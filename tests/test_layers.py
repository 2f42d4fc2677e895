"""The package's import structure, read from the source with `ast` (nothing under attncal/ is imported).

Layers, lowest first; a module may import its own layer and lower ones:

    0 foundation  attncal.messages, versions, cpuinfo, native, memory, modelinfo, pooling, console, synthetic ...
                  (every module at the package root that is not named below)
    1 calibration
    2 artifact
    3 graphs
    4 runtime
    5 exporting, serving, eval   (siblings: none imports another)
    6 bench, corpus           (siblings)
    7 cli

Inside a layer's package, its rooms (`ROOMS`) are ordered the same way: `attncal.graphs`' own modules (the node
builder, the graph-pass protocol) lowest, then the calibration ops (`graphs.ops`), then the placements and the
fusions, siblings; in `attncal.artifact`, the layout, then the checks on untrusted input, then the metadata and
the ONNX files (siblings), then the whole export, and the package's front that re-exports them last.

`attncal/__init__.py` and `attncal/__main__.py` are the package's lazy_loader front and are exempt as importers.
Imports under `if TYPE_CHECKING:` are not executed and are not checked.  Top-level imports (module body,
including `if`/`try`/class bodies) must form no cycle.  Imports of attncal modules inside functions are allowed
only with a reason (a comment containing `lazy:` on the import's first line or in the comment lines directly
above it) and at most `LAZY_LIMIT` of them in the whole package.  Importing the package front from inside is
refused too, except the names it defines itself (`__version__`): any other name there is a re-export that hides
the module it comes from.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attncal"
LAZY_LIMIT = 40

# (layer, sibling group): the group names the layer's members that must not import each other
LAYERS = {
    "calibration": (1, "calibration"),
    "artifact": (2, "artifact"),
    "graphs": (3, "graphs"),
    "runtime": (4, "runtime"),
    "exporting": (5, "exporting"), "serving": (5, "serving"), "eval": (5, "eval"),
    "bench": (6, "bench"), "corpus": (6, "corpus"),
    "cli": (7, "cli"),
}
# Rooms inside a layer's package: subpackage -> (rank, sibling group); the package's own modules are room "".
ROOMS = {
    "graphs": {"": (0, "graphs"), "ops": (1, "ops"), "placements": (2, "placements"), "fusions": (2, "fusions")},
    "artifact": {"layout": (0, "layout"), "checks": (1, "checks"), "metadata": (2, "metadata"),
                 "onnx_io": (2, "onnx_io"), "export_dir": (3, "export_dir"), "": (4, "artifact")},
}
EXEMPT = ("__init__", "__main__")  # the root package's own files, as dotted tails
LAYER_NAMES = {0: "foundation", 1: "calibration", 2: "artifact", 3: "graphs", 4: "runtime",
               5: "exporting/serving/eval", 6: "bench/corpus", 7: "cli"}


@dataclass(frozen=True)
class Import:
    file: Path        # the importing source file
    line: int         # the import statement's first line
    importer: str     # dotted name of the importing module
    target: str       # dotted name of the imported package module (the most specific one that exists)
    lazy: bool        # inside a function
    reason: bool      # a `lazy:` comment on the first line or in the comment lines directly above
    name: str | None = None  # for an import from the package front itself (`from .. import x`): x


def module_name(path: Path, root: Path) -> str:
    """Dotted name of a source file under `root` (the package directory): a package's __init__ is the package."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str, root: Path) -> bool:
    """Whether a dotted name is a module or package inside the package at `root`."""
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    base = root / rel
    return name == root.name or base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool = False):
    """(import node, inside a function) for every import under `node`, skipping `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:  # the `else:` branch does run
                yield from _walk(ast.Module(body=[sub], type_ignores=[]), in_function)
        else:
            func = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _walk(child, in_function or func)


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool,
             root: Path) -> list[tuple[str, str | None]]:
    """(module, name) for the package modules one import statement loads (relative imports resolved, submodule
    names recognised); the name is set only for a name imported from the package front itself."""
    top = root.name
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name == top or a.name.startswith(top + ".")]
    if node.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        if node.level - 1 >= len(package):
            raise ValueError(f"{importer}: relative import beyond the top-level package (line {node.lineno})")
        base = ".".join(package[: len(package) - (node.level - 1)])
        module = f"{base}.{node.module}" if node.module else base
    else:
        module = node.module or ""
    if module != top and not module.startswith(top + "."):
        return []
    out = []
    for alias in node.names:
        sub = f"{module}.{alias.name}"
        if alias.name != "*" and _exists(sub, root):
            out.append((sub, None))
        else:
            out.append((module, alias.name if module == top else None))
    return list(dict.fromkeys(out))


def _comment_above(lines: list[str], lineno: int) -> str:
    """The comment lines that end directly above line `lineno` (1-based), joined; "" when that line is code."""
    block = []
    for line in reversed(lines[: lineno - 1]):
        if not line.lstrip().startswith("#"):
            break
        block.append(line)
    return "\n".join(block)


def scan(root: Path = PACKAGE) -> list[Import]:
    """Every import of a module of the package at `root`, from every source file under it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node, lazy in _walk(ast.parse(source, filename=str(path))):
            first = lines[node.lineno - 1].partition("#")[2]
            reason = "lazy:" in first or "lazy:" in _comment_above(lines, node.lineno)
            for target, name in _targets(node, importer, path.name == "__init__.py", root):
                found.append(Import(path, node.lineno, importer, target, lazy, reason, name))
    return found


def layer(name: str) -> tuple[int, str] | None:
    """(layer, sibling group) of a dotted module name; None for the exempt front (the root package, __main__)."""
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in EXEMPT:
        return None
    return LAYERS.get(parts[1], (0, "foundation"))


def room(name: str) -> tuple[str, str, int, str] | None:
    """(package, room, rank, sibling group) of a module inside a package with rooms (`ROOMS`); None outside."""
    parts = name.split(".")
    rooms = ROOMS.get(parts[1]) if len(parts) > 1 else None
    if rooms is None:
        return None
    sub = parts[2] if len(parts) > 2 and parts[2] in rooms else ""
    return (parts[1], sub, *rooms[sub])


def room_violations(imports: list[Import], root: Path = PACKAGE) -> list[str]:
    """One line per import, inside a package with rooms, from a room to a higher one or to a sibling."""
    bad = []
    for imp in imports:
        src, dst = room(imp.importer), room(imp.target)
        if src is None or dst is None or src[0] != dst[0] or src[1] == dst[1]:
            continue
        if dst[2] > src[2] or (dst[2] == src[2] and dst[3] != src[3]):
            kind = "a higher room" if dst[2] > src[2] else "a sibling room"
            bad.append(f"{_where(imp, root)}: {imp.importer} ({src[0]}.{src[1] or '(own modules)'}) imports "
                       f"{imp.target} ({kind}: {dst[0]}.{dst[1] or '(own modules)'})")
    return bad


def _where(imp: Import, root: Path) -> str:
    return f"{imp.file.relative_to(root.parent).as_posix()}:{imp.line}"


def front_defines(root: Path = PACKAGE) -> set[str]:
    """The names the package front binds itself (`__version__`, ...), not by importing them."""
    names: set[str] = set()
    for node in ast.parse((root / "__init__.py").read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def layer_violations(imports: list[Import], root: Path = PACKAGE) -> list[str]:
    """One line per import that goes up the layer order or across to a sibling, or takes from the package front
    a name the front only re-exports (the front is loaded first anyway, so its own names, `__version__`, are
    fine; a re-exported one hides the module it comes from)."""
    bad = []
    own = front_defines(root)
    for imp in imports:
        src, dst = layer(imp.importer), layer(imp.target)
        if src is None:
            continue
        if dst is None:
            if imp.target == root.name and imp.name in own:
                continue
            what = f"{imp.name!r} from " if imp.name else ""
            bad.append(f"{_where(imp, root)}: {imp.importer} ({LAYER_NAMES[src[0]]}) imports {what}the package "
                       f"front {imp.target}; import it from the module that defines it")
        elif dst[0] > src[0] or (dst[0] == src[0] and dst[1] != src[1]):
            kind = "a higher layer" if dst[0] > src[0] else "a sibling"
            bad.append(f"{_where(imp, root)}: {imp.importer} ({LAYER_NAMES[src[0]]}: {src[1]}) imports {imp.target} "
                       f"({kind}: {LAYER_NAMES[dst[0]]}: {dst[1]})")
    return bad


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    """Top-level import edges.  Loading a.b.c runs a and a.b first, so an edge also goes to each package on the
    target's path that is not already a package of the importer (that one is mid-import anyway)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.lazy:
            continue
        own = {".".join(imp.importer.split(".")[:i]) for i in range(1, imp.importer.count(".") + 2)}
        parts = imp.target.split(".")
        for i in range(2, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in own:
                graph.setdefault(imp.importer, set()).add(name)
    return graph


def cycles(imports: list[Import]) -> list[list[str]]:
    """One cycle (a -> ... -> a) for each strongly connected group of modules joined by top-level imports."""
    graph = _graph(imports)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package's depth keeps the recursion shallow
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(sorted(g)[0], g, graph) for g in groups]


def _cycle_in(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected group (breadth first)."""
    paths = {w: [start, w] for w in sorted(graph.get(start, ())) if w in group}
    queue = list(paths)
    while queue:
        v = queue.pop(0)
        if v == start:
            return paths[v]
        for w in sorted(graph.get(v, ())):
            if w in group and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")  # unreachable for a strongly connected group


def lazy_problems(imports: list[Import], root: Path = PACKAGE, limit: int = LAZY_LIMIT) -> list[str]:
    """Function-level imports of package modules: over the limit (all listed), or any without a `lazy:` reason."""
    seen: dict[tuple[Path, int], Import] = {}
    for imp in imports:
        if imp.lazy and layer(imp.importer) is not None:
            seen.setdefault((imp.file, imp.line), imp)
    lazy = sorted(seen.values(), key=lambda i: (str(i.file), i.line))
    problems = [f"{_where(i, root)}: function-level import of {i.target} has no `lazy:` reason comment"
                for i in lazy if not i.reason]
    if len(lazy) > limit:
        problems.append(f"{len(lazy)} function-level imports of {root.name} modules (at most {limit}): "
                        + ", ".join(_where(i, root) for i in lazy))
    return problems


def test_no_import_goes_against_the_layer_order():
    bad = layer_violations(scan())
    assert not bad, f"{len(bad)} imports against the layer order:\n" + "\n".join(bad)


def test_no_import_goes_against_the_room_order():
    bad = room_violations(scan())
    assert not bad, f"{len(bad)} imports against the room order:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    found = cycles(scan())
    assert not found, "top-level import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_function_level_imports_few_and_explained():
    bad = lazy_problems(scan())
    assert not bad, "\n".join(bad)


def test_the_package_is_seen():
    """The scan reads the real package: a layout change that hides modules from it fails here."""
    imports = scan()
    importers = {i.importer for i in imports}
    assert {"attncal.cli", "attncal.artifact", "attncal.runtime.encoder"} <= importers
    assert any(i.target.startswith("attncal.calibration") for i in imports)


# --- the checks themselves: each one reports what it should, on a package written to a temp directory ---

_SYNTHETIC = {
    "__init__.py": "from .cli import main\n__version__ = '1'\n",
    "messages.py": "",
    "artifact.py": ("from typing import TYPE_CHECKING\n"
                    "from . import messages\n"
                    "if TYPE_CHECKING:\n"
                    "    from .runtime import Encoder\n"
                    "def f():\n"
                    "    from .cli.main import run  # lazy: a reason does not excuse a layer violation\n"),
    "calibration/__init__.py": "from . import a\n",
    "calibration/a.py": "from .b import x\n",
    "calibration/b.py": "from ..calibration import a\nx = 1\n",
    "runtime/__init__.py": "from .encoder import Encoder\n",
    "runtime/encoder.py": ("from .. import artifact\n"
                           "from ..graphs import passes\n"
                           "Encoder = 1\n"),
    "graphs/__init__.py": "",
    "graphs/passes.py": ("import attncal.messages\n"
                         "def g():\n"
                         "    # lazy: explained on the line above\n"
                         "    from ..runtime.encoder import Encoder\n"
                         "    from ..artifact import messages\n"),
    "exporting/__init__.py": "",
    "exporting/run.py": ("from ..serving import thing\n"
                      "def h():\n"
                      "    from ..runtime import Encoder  # lazy: optional dependency\n"),
    "serving/__init__.py": "thing = 1\n",
    "cli/__init__.py": "from .main import run\n",
    "cli/main.py": "import attncal\nfrom ..exporting import run\nfrom attncal.bench import *\nfrom .. import __version__\n",
    "bench/__init__.py": "from attncal import main\n",
}


def _synthetic(tmp_path: Path) -> Path:
    root = tmp_path / "attncal"
    for rel, text in _SYNTHETIC.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_scan_resolves_relative_imports(tmp_path):
    root = _synthetic(tmp_path)
    edges = {(i.importer, i.target, i.lazy) for i in scan(root)}
    assert ("attncal.calibration", "attncal.calibration.a", False) in edges       # `from . import a` in an __init__
    assert ("attncal.calibration.a", "attncal.calibration.b", False) in edges     # `from .b import x`
    assert ("attncal.calibration.b", "attncal.calibration.a", False) in edges     # `from ..calibration import a`
    assert ("attncal.runtime.encoder", "attncal.artifact", False) in edges        # `from .. import artifact`
    assert ("attncal.runtime.encoder", "attncal.graphs.passes", False) in edges   # a name that is a submodule
    assert ("attncal.graphs.passes", "attncal.artifact", True) in edges           # a name that is not one
    assert ("attncal.cli.main", "attncal", False) in edges                        # the front itself
    assert ("attncal.cli.main", "attncal.bench", False) in edges                  # a star import
    assert not any(i.target == "attncal.runtime" and i.importer == "attncal.artifact" for i in scan(root)), \
        "an `if TYPE_CHECKING:` import was read"


def test_layer_check_reports_violations(tmp_path):
    root = _synthetic(tmp_path)
    bad = layer_violations(scan(root), root)
    assert len(bad) == 5, bad
    assert any(b.startswith("attncal/artifact.py:6: attncal.artifact (artifact: artifact) imports attncal.cli.main "
                            "(a higher layer: cli: cli)") for b in bad)
    assert any(b.startswith("attncal/graphs/passes.py:4: ") and "attncal.runtime.encoder" in b for b in bad)
    assert any(b.startswith("attncal/exporting/run.py:1: ") and "(a sibling: exporting/serving/eval: serving)" in b
               for b in bad)
    assert any(b.startswith("attncal/cli/main.py:1: ") and "package front" in b for b in bad)
    assert any(b.startswith("attncal/bench/__init__.py:1: ") and "imports 'main' from the package front" in b
               for b in bad)
    assert not any("cli/main.py:4" in b for b in bad), "the front's own __version__ was refused"


def test_cycle_check_reports_cycles(tmp_path):
    root = _synthetic(tmp_path)
    found = cycles(scan(root))
    assert ["attncal.calibration.a", "attncal.calibration.b", "attncal.calibration.a"] in found, found
    # runtime.encoder -> graphs.passes is top-level, graphs.passes -> runtime.encoder is lazy: no cycle
    assert not any("attncal.runtime.encoder" in c for c in found), found
    assert len(found) == 1, found


def test_lazy_check_reports_unexplained_and_too_many(tmp_path):
    root = _synthetic(tmp_path)
    imports = scan(root)
    bad = lazy_problems(imports, root)
    assert bad == ["attncal/graphs/passes.py:5: function-level import of attncal.artifact has no `lazy:` reason "
                   "comment"]
    over = lazy_problems(imports, root, limit=3)
    assert len(over) == 2 and over[1].startswith("4 function-level imports of attncal modules (at most 3): ")
    assert "attncal/artifact.py:6" in over[1] and "attncal/exporting/run.py:3" in over[1]


def test_room_check_reports_violations(tmp_path):
    root = tmp_path / "attncal"
    files = {
        "__init__.py": "", "graphs/__init__.py": "",
        "graphs/builder.py": "from .ops import contract\n",                      # own modules -> ops: up
        "graphs/ops/__init__.py": "", "graphs/ops/contract.py": "from .. import builder\n",
        "graphs/fusions/__init__.py": "", "graphs/fusions/rotary.py": "from ..placements import rule\n",
        "graphs/placements/__init__.py": "",
        "graphs/placements/rule.py": "from ..ops.contract import x\nfrom ..builder import y\nfrom . import other\n",
        "graphs/placements/other.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    bad = room_violations(scan(root), root)
    assert len(bad) == 2, bad
    assert bad[0].startswith("attncal/graphs/builder.py:1: attncal.graphs.builder (graphs.(own modules)) imports "
                             "attncal.graphs.ops.contract (a higher room: graphs.ops)"), bad
    assert bad[1].startswith("attncal/graphs/fusions/rotary.py:1: ") and "(a sibling room: graphs.placements)" in bad[1]
