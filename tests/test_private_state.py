"""attncal does not reach into other libraries' private state (docs/development.md, house rules).

An AST scan of every module under attncal/ fails on:

* `unittest.mock` imported (patching another library's functions at run time);
* `gc.get_objects` (finding another library's objects behind its back);
* `__globals__` (reaching a module through a function's globals);
* a write or delete of an underscore attribute (`x._name = ...`, `del x._name`, `setattr(x, "_name", ...)`)
  on anything but `self` / `cls`: the object may be another library's, whose private fields are its own.
  attncal's own annotations on objects it does not own are namespaced `_attncal_...` and allowed.

`KNOWN` lists what the code still does, each with what replaces it; the list may only shrink (the test fails
on a listed hit that is gone).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OWN_PREFIX = "_attncal"

# (module, what the scan reports): still in the code, to be replaced (with what).  Empty: nothing is left.
KNOWN: dict[tuple[str, str], str] = {}


def _private_write(target: ast.AST) -> list[str]:
    out = []
    for node in ast.walk(target):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)) \
                and node.attr.startswith("_") and not node.attr.startswith(OWN_PREFIX) \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.append(f"write {ast.unparse(node)}")
    return out


def private_state(source: str) -> list[tuple[int, str]]:
    """(line, what) of every reach into private state in `source`."""
    hits: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hits += [(node.lineno, "import unittest.mock") for a in node.names if a.name.startswith("unittest.mock")]
        elif isinstance(node, ast.ImportFrom):
            if node.module == "unittest.mock" or (node.module == "unittest"
                                                  and any(a.name == "mock" for a in node.names)):
                hits.append((node.lineno, "import unittest.mock"))
            elif node.module == "gc" and any(a.name == "get_objects" for a in node.names):
                hits.append((node.lineno, "gc.get_objects"))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if node.attr == "__globals__":
                hits.append((node.lineno, "__globals__"))
            elif node.attr == "get_objects" and isinstance(node.value, ast.Name) and node.value.id == "gc":
                hits.append((node.lineno, "gc.get_objects"))
        elif isinstance(node, (ast.Assign, ast.Delete)):
            hits += [(node.lineno, w) for t in node.targets for w in _private_write(t)]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            hits += [(node.lineno, w) for w in _private_write(node.target)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and node.args[1].value.startswith("_") \
                and not node.args[1].value.startswith(OWN_PREFIX):
            hits.append((node.lineno, f"write {ast.unparse(node.args[0])}.{node.args[1].value}"))
    return sorted(hits)


def _scan() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted((REPO / "attncal").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for line, what in private_state(path.read_text(encoding="utf-8")):
            found.setdefault((rel, what), []).append(line)
    return found


def test_no_new_reach_into_private_state():
    found = _scan()
    new = [f"{f}:{lines[0]}: {what}" for (f, what), lines in found.items() if (f, what) not in KNOWN]
    assert not new, ("attncal reaches into another library's private state (use its public API, or namespace "
                     f"attncal's own attribute {OWN_PREFIX}_...):\n" + "\n".join(new))


def test_known_reaches_are_still_there():
    gone = [f"{f}: {what}" for (f, what) in KNOWN if (f, what) not in _scan()]
    assert not gone, f"remove from KNOWN in tests/test_private_state.py, the code no longer does it: {gone}"


def test_scan_sees_each_kind():
    planted = (
        "import gc\nfrom unittest import mock\nimport unittest.mock as um\nfrom unittest.mock import patch\n"
        "def f(obj, fn, cfg):\n"
        "    g = fn.__globals__\n"
        "    for o in gc.get_objects():\n"
        "        o._graph = None\n"
        "    cfg._attn_implementation = 'eager'\n"
        "    setattr(cfg, '_x', 1)\n"
        "    del obj._cache\n"
        "    obj._n += 1\n"
        "    import sys; sys.modules[__name__].__class__ = type\n"
        "class C:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "        other._attncal_state = 2\n"
        "        setattr(other, '_attncal_sites', 3)\n"
        "        self.public = other._private\n"
    )
    assert private_state(planted) == [
        (2, "import unittest.mock"), (3, "import unittest.mock"), (4, "import unittest.mock"),
        (6, "__globals__"), (7, "gc.get_objects"), (8, "write o._graph"), (9, "write cfg._attn_implementation"),
        (10, "write cfg._x"), (11, "write obj._cache"), (12, "write obj._n"),
        (13, "write sys.modules[__name__].__class__")]
