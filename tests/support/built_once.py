"""A directory built once per test run, shared by the modules that ask for it and by the run's xdist workers.

Several test modules need the same read-only inputs (an export of the same tiny model, say), and a module
fixture builds them again for each module.  `built_once` builds into a private directory of the run's own
temporary root (which its xdist workers share) and renames it into place; whoever asks later gets that
directory.  Where two workers build at once, the first rename wins and the other's copy is dropped.  No other
run sees it.  The users must treat it as read-only.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The directory `name`, made by `build(path)` in the first test module of this run that asks for it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "built-once"
    root.mkdir(parents=True, exist_ok=True)
    dest = root / name
    if not dest.is_dir():
        tmp = root / f".{name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        try:
            os.replace(tmp, dest)  # atomic; fails where another worker got there first
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
