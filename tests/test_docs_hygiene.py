"""Documentation hygiene: the docs and code comments read as a product, and the references are complete.

* No internal references in README.md, docs/ (pages, scripts and committed results) or the sources under attncal/, benchmarks/, plugins/ and
  tests/: no session chronology, no issue or stop numbers, no absolute paths of one machine. Text
  states the design and the reason; history belongs in CHANGELOG.md, superseded figures on
  docs/performance-log.md.
* README.md is a short front page: at most 150 lines, cites the paper, states the licence and has the
  "which file to load" table.

The command-line reference and the other generated parts of the docs are checked in
tests/test_generated_docs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 150
PAPER = "2606.02737"
LICENCE = "Apache-2.0"

# The house check, plus other forms of session chronology. Assembled from parts so that this file
# does not match itself.
_S = "sess" + "ion"
INTERNAL = re.compile("|".join([
    rf"(next|previous|earlier|last|this|that) {_S}\b",
    r"later that day", r"a day later", r"the next day",
    r"\bissue [0-9]+", r"\bstop [0-9]+",
    r"/tmp/[a-z0-9]", "/wo" + "rk/", "/ro" + "ot/",
    rf"\b{_S}s? (later|earlier|ago)\b",
    rf"\b(two|three|four|several|a few) {_S}s (later|earlier|ago)\b",
    rf"project's {_S}s",
    rf"\b{_S} [0-9]+\b",
    r"\b(yesterday|tomorrow)\b",
    r"(?<!\.)\btoday('s)?\b",  # not date.today()
    r"closing note of",
]), re.IGNORECASE)

SOURCE_DIRS = ("attncal", "benchmarks", "plugins", "tests")
SOURCE_SUFFIXES = {".py", ".h", ".hpp", ".cc", ".cu", ".cuh", ".cpp"}


def _files() -> list[Path]:
    files = [README, REPO / "CHANGELOG.md"]
    files += sorted(p for p in (REPO / "docs").rglob("*") if p.suffix in (".md", ".py", ".json"))
    for d in SOURCE_DIRS:
        files += sorted(p for p in (REPO / d).rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())
    return [p for p in files if p.is_file() and p.resolve() != Path(__file__).resolve()]


def internal_references(files=None) -> list[str]:
    hits = []
    for path in files or _files():
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if INTERNAL.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:160]}")
    return hits


def test_pattern_catches_internal_references():
    bad = ["measured in the next " + _S, "see issue 20", "stop 31's CI", "/tmp/old/lib.so",
           "two " + _S + "s later", "on today's VM", "later that day"]
    good = ["the ONNX Runtime " + _S + " created first", "InferenceSession", "a temporary directory",
            "tests/test_x.py", "build/plugins/libattncal_ort.so", "datetime.date.today().isoformat()"]
    assert all(INTERNAL.search(s) for s in bad), [s for s in bad if not INTERNAL.search(s)]
    assert not any(INTERNAL.search(s) for s in good), [s for s in good if INTERNAL.search(s)]


def test_no_internal_references():
    hits = internal_references()
    assert not hits, ("internal references (session chronology, issue numbers, machine paths) in docs or "
                      "code; state the design and the reason, and move history to CHANGELOG.md:\n"
                      + "\n".join(hits))


def test_readme_front_page():
    text = README.read_text(encoding="utf-8")
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}); move detail to docs/"
    assert f"arXiv {PAPER}" in text and "@misc{" in text, "README.md must cite the paper with a BibTeX entry"
    assert LICENCE in text, "README.md must state the licence"
    header = re.search(r"^\| *runtime *\| *file *\| *what it needs *\|$", text, re.MULTILINE)
    assert header, "README.md must have the 'which file to load' table (runtime | file | what it needs)"
    for name in ("onnx/model.onnx", "onnx/model_optimized.onnx", "onnx/model_optimized_native.onnx"):
        assert name in text, f"README.md does not name {name}"
    assert "make demo" in text and "make test" in text
