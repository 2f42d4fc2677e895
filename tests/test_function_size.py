"""No function in attncal/ over `LIMIT` lines without a reason (docs/development.md, house rules).

A function's length runs from its `def` (or its first decorator) to its last line, signature and docstring
included.  One over the limit states why it is one piece in its docstring, on a line starting `long:`; the
scan reads the source with `ast` (nothing is imported).  `KNOWN` lists the long functions still without a
reason, each in a module another change owns at the moment; the list may only shrink (the test fails on a
listed function that has a reason, is shorter, or is gone).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIMIT = 80
MARKER = "long:"

# (module, qualified name): long, no reason yet.
KNOWN = {
    ("attncal/corpus/api.py", "encode_corpus"),
    ("attncal/corpus/api.py", "_encode_sequential"),
    ("attncal/serving/repository.py", "build_repository"),
    ("attncal/serving/bench.py", "bench_triton"),
}


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int, bool]]:
    """(qualified name, lines, has a `long:` reason) of every function in `source` over `limit` lines."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    start = child.decorator_list[0].lineno if child.decorator_list else child.lineno
                    lines = child.end_lineno - start + 1
                    if lines > limit:
                        doc = ast.get_docstring(child) or ""
                        reason = any(line.strip().startswith(MARKER) for line in doc.splitlines())
                        out.append((name, lines, reason))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def _scan() -> dict[tuple[str, str], tuple[int, bool]]:
    found = {}
    for path in sorted((REPO / "attncal").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for name, lines, reason in long_functions(path.read_text(encoding="utf-8")):
            found[(rel, name)] = (lines, reason)
    return found


def test_long_functions_give_a_reason():
    bad = [f"{f}: {name} is {lines} lines" for (f, name), (lines, reason) in _scan().items()
           if not reason and (f, name) not in KNOWN]
    assert not bad, (f"functions over {LIMIT} lines without a `{MARKER}` line in their docstring (split them, or "
                     "say why they are one piece):\n" + "\n".join(bad))


def test_known_long_functions_are_still_there():
    found = _scan()
    gone = [f"{f}: {name}" for (f, name) in KNOWN if (f, name) not in found or found[(f, name)][1]]
    assert not gone, f"remove from KNOWN in tests/test_function_size.py (shorter now, gone, or given a reason): {gone}"


def test_scan_sees_long_functions():
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT))
    planted = (
        f"def short():\n    return 1\n\n"
        f"def too_long():\n    '''No reason.'''\n{body}\n"
        f"def explained():\n    '''Why it is one piece.\n\n    long: a planted reason.'''\n{body}\n"
        f"class C:\n    @property\n    def method(self):\n{body.replace('    ', '        ')}"
        f"def limit():\n{''.join(f'    y{i} = {i}' + chr(10) for i in range(LIMIT - 1))}"
        f"def mentions():\n    '''Says long: in passing, not on a line of its own.'''\n{body}"
    )
    assert long_functions(planted) == [("too_long", LIMIT + 2, False), ("explained", LIMIT + 4, True),
                                       ("C.method", LIMIT + 2, False), ("mentions", LIMIT + 2, False)]
