"""The documentation that is generated or checked against the code:

* every block `docs/generate.py` writes (the command-line reference from `attncal.cli.build_parser()`, the
  option conflicts from `attncal.exporting.plan.CONFLICTS`, the evaluation tables from the committed
  `docs/eval/*/results.json`) is what the script writes now;
* the API reference pages (mkdocstrings) document every public name of `attncal`;
* the configuration page names every environment variable the code reads, and its version ranges are the
  ones the package declares.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

import attncal
from attncal.artifact import GRAPH_FILES
from attncal.cli import build_parser
from attncal.cli.doctor import _TESTED as TESTED_LIBRARIES
from attncal.exporting.plan import CONFLICTS
from attncal.graphs.placements import CHOICES, PLACEMENTS
from attncal.versions import declared_ranges

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "reference"
CONFIGURATION = REPO / "docs" / "configuration.md"
REGENERATE = "run `python docs/generate.py` and commit the pages it rewrites"


def _load_generator():
    spec = importlib.util.spec_from_file_location("docs_generate", REPO / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


generate = _load_generator()


# -- generated blocks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(generate.BLOCKS))
def test_generated_block_is_current(name):
    block = generate.BLOCKS[name]
    assert generate.committed(name) == generate.rendered(name), (
        f"{block.page.relative_to(REPO)}: the generated block '{name}' is stale; {REGENERATE}")


def test_a_stale_block_is_found_and_rewritten(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(f"# Page\n\nbefore\n\n{generate._begin('x')}\nold\n{generate._end('x')}\n\nafter\n",
                    encoding="utf-8")
    monkeypatch.setattr(generate, "REPO", tmp_path)
    monkeypatch.setattr(generate, "BLOCKS", {"x": generate.Block(page, lambda: "| a |\n|---|\n| 1 |\n")})
    assert generate.main(["--check"]) == 1
    assert generate.main([]) == 0
    assert generate.stale() == []
    assert page.read_text(encoding="utf-8") == (f"# Page\n\nbefore\n\n{generate._begin('x')}\n\n| a |\n|---|\n| 1 |\n\n"
                                                f"{generate._end('x')}\n\nafter\n")


def test_a_block_without_its_markers_is_an_error(tmp_path, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text(f"{generate._begin('x')}\nno end\n", encoding="utf-8")
    monkeypatch.setattr(generate, "REPO", tmp_path)
    monkeypatch.setattr(generate, "BLOCKS", {"x": generate.Block(page, lambda: "text\n")})
    assert generate.main([]) == 2
    assert "page.md: needs exactly one" in capsys.readouterr().err
    assert page.read_text(encoding="utf-8") == f"{generate._begin('x')}\nno end\n"


def _peer_row(engine: str, times_ms: list[float], probes: list[float] | None) -> dict:
    return {"engine": engine, "batch": 8, "seq": 128, "p50_ms": sorted(times_ms)[len(times_ms) // 2],
            "times_ms": times_ms, "peak_mib_probes": probes, "peak_mib": probes and sorted(probes)[len(probes) // 2]}


@pytest.mark.parametrize("ours_ms, ours_mib, time_says, memory_says", [
    ([50, 51, 52, 49, 50], [10, 11, 10], "ahead", "ahead"),
    ([120, 121, 119, 122, 120], [60, 61, 62], "behind", "behind"),
    ([100, 102, 98, 101, 99], [40, 50, 45], "level", "level"),
])
def test_peer_verdict_compares_with_the_best_peer(ours_ms, ours_mib, time_says, memory_says):
    run = {"meta": {"peer": "ort-opt"}}
    rows = [_peer_row("ort-opt", [200, 201, 199, 202, 200], [80, 80, 80]),
            _peer_row("openvino", [100, 101, 99, 100, 102], [90, 90, 91]),  # the fastest peer
            _peer_row("torch-sdpa", [300, 301, 299, 300, 302], [42, 44, 43]),  # the smallest peer
            _peer_row(generate.OURS, ours_ms, ours_mib)]
    by = {(r["engine"], r["batch"], r["seq"]): r for r in rows}
    time = generate._peer_verdict("BERT", run, by, 8, 128, "time")
    memory = generate._peer_verdict("BERT", run, by, 8, 128, "memory")
    assert (time.verdict, time.peer, memory.verdict, memory.peer) == (time_says, "openvino", memory_says, "torch-sdpa")
    del by["torch-sdpa", 8, 128]
    assert generate._peer_verdict("BERT", run, by, 8, 128, "time").describe() == (
        "not compared at 8 × 128 (`torch-sdpa` did not run)")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_cli_reference_documents_every_subcommand_and_option():
    text = generate.rendered("cli-options")
    missing = []
    for command, sp in _subparsers().items():
        if f"### `attncal {command}`" not in text:
            missing.append(f"attncal {command}")
        missing += [f"attncal {command} {o}" for a in sp._actions if not isinstance(a, argparse._HelpAction)
                    for o in a.option_strings if f"`{o}`" not in text]
    assert not missing, f"the generated command-line reference misses: {missing}"


def test_cli_page_names_every_placement_and_graph_file():
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    missing = [f"placement {p}" for p in (*CHOICES, *PLACEMENTS) if f"`{p}`" not in text]
    missing += [f"graph {g}" for g in GRAPH_FILES if g not in text]
    assert not missing, f"docs/cli.md does not name: {missing}"


def test_every_export_conflict_is_documented_with_its_options():
    text = generate.rendered("export-conflicts")
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(CONFLICTS)
    assert "`attncal export --quantize int8 --fp16`" in text  # the two precisions exclude each other


# -- the API reference ------------------------------------------------------------------------------------

def _documented() -> set[str]:
    """The dotted paths the reference pages document: each `::: path`, and each member it lists."""
    out = set()
    for page in REFERENCE.glob("*.md"):
        current, in_members = None, False
        for line in page.read_text(encoding="utf-8").splitlines():
            if line.startswith("::: "):
                current, in_members = line[4:].strip(), False
                out.add(current)
            elif current and line.strip() == "members:":
                in_members = True
            elif current and in_members and re.match(r"^\s+- \w+$", line):
                out.add(f"{current}.{line.strip()[2:]}")
            elif line.strip() and not line.startswith(" "):
                current, in_members = None, False
    return out


def _resolve(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def test_api_reference_documents_every_public_name():
    documented = {}
    for path in _documented():
        try:
            documented[id(_resolve(path))] = path
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"docs/reference: `::: {path}` does not resolve ({exc})")
    missing = []
    for name in attncal.__all__:
        if name == "__version__":
            continue
        obj = getattr(attncal, name)
        if id(obj) not in documented:
            missing.append(name)
    assert not missing, f"attncal.__all__ names without a page in docs/reference/: {missing}"


def test_api_reference_resolution_sees_members():
    assert "attncal.native.get_library_path" in _documented()


# -- the configuration page --------------------------------------------------------------------------------

# os.environ / getenv with a literal name, and the module constants that hold a variable's name.
_PY_ENV = re.compile(r"(?:environ(?:\.get|\.setdefault|\.pop)?\(\s*|environ\[\s*|\b[A-Z_]*ENV[A-Z_]*\s*=\s*)"
                     r"\"([A-Z][A-Z0-9_]+)\"")
_C_ENV = re.compile(r"(?:getenv\(\s*\"|\$ENV\{|kIsaPathEnv = \")([A-Z][A-Za-z0-9_]+)")


def environment_variables() -> set[str]:
    """Every variable the package and the native build read, and attncal's own that the test suite reads."""
    names = set()
    for path in (REPO / "attncal").rglob("*.py"):
        names |= set(_PY_ENV.findall(path.read_text(encoding="utf-8")))
    for path in (REPO / "tests").rglob("*.py"):
        names |= {n for n in _PY_ENV.findall(path.read_text(encoding="utf-8")) if n.startswith("ATTNCAL_")}
    for path in (REPO / "plugins").rglob("*"):
        if path.suffix in (".h", ".cc", ".cpp", ".cu", ".cmake", ".txt") and path.is_file():
            names |= set(_C_ENV.findall(path.read_text(encoding="utf-8", errors="replace")))
    return names


def test_environment_scan_finds_the_known_variables():
    assert {"ATTNCAL_NATIVE", "ATTNCAL_CPU_PATH", "ATTNCAL_TENSORRT_HEADERS", "HF_HUB_OFFLINE"} <= environment_variables()


def test_configuration_page_names_every_environment_variable():
    text = CONFIGURATION.read_text(encoding="utf-8")
    missing = sorted(n for n in environment_variables() if f"`{n}`" not in text)
    assert not missing, f"docs/configuration.md does not describe these environment variables: {missing}"


def _version_table() -> dict[str, str]:
    text = CONFIGURATION.read_text(encoding="utf-8")
    section = text.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| (\S+) \| `([^`]+)` \|", section, re.MULTILINE)}


def test_configuration_version_ranges_are_the_declared_ones():
    table, declared = _version_table(), declared_ranges()
    assert set(table) == set(TESTED_LIBRARIES), (set(table), TESTED_LIBRARIES)
    wrong = {lib: (rng, declared.get(lib)) for lib, rng in table.items()
             if lib not in declared or SpecifierSet(rng) != SpecifierSet(declared[lib])}
    assert not wrong, f"docs/configuration.md's ranges differ from pyproject.toml's (page, declared): {wrong}"
