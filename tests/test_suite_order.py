"""The suite's file order under pytest-xdist (tests/conftest.py): the longest files are handed out first."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from conftest import LONGEST_FILES_FIRST, pytest_collection_modifyitems

TESTS = Path(__file__).resolve().parent


def test_every_listed_file_exists():
    """A renamed file would silently drop out of the order."""
    missing = [name for name in LONGEST_FILES_FIRST if not (TESTS / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FILES_FIRST names files that do not exist: {missing}"
    assert len(set(LONGEST_FILES_FIRST)) == len(LONGEST_FILES_FIRST)


def test_make_test_keeps_the_collection_order():
    """Without --no-loadscope-reorder, xdist sorts the files by their number of tests and the order is lost."""
    recipe = (TESTS.parent / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    command = next(line for line in recipe.splitlines() if " pytest " in line)
    assert re.search(r"--dist[ =]loadfile", command) and "--no-loadscope-reorder" in command, command


def test_listed_files_go_first_and_each_file_keeps_its_order():
    def item(name: str, test: str):
        return SimpleNamespace(path=TESTS / name, nodeid=f"tests/{name}::{test}")

    first, second = LONGEST_FILES_FIRST[:2]
    items = [item("test_a.py", "t1"), item(second, "t1"), item("test_a.py", "t2"), item(first, "t1"),
             item(second, "t2"), item("test_b.py", "t1"), item(first, "t2")]
    pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [
        f"tests/{first}::t1", f"tests/{first}::t2", f"tests/{second}::t1", f"tests/{second}::t2",
        "tests/test_a.py::t1", "tests/test_a.py::t2", "tests/test_b.py::t1"]
