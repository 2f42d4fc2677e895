"""The lowest versions pyproject.toml allows: the tests of the code that depends on other libraries' internals
(the int8 quantizer against quantize_dynamic, the fp16 conversion, the tokenizer check against transformers,
the version checks) run again with onnx, transformers and numpy at their declared floors
(tests/lowest/requirements.txt, installed by `make test` into .venv/lowest-overlay), in a subprocess where that
overlay shadows the main environment.  The rest of the suite runs with the newest versions the ranges allow."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from attncal import versions

REPO = Path(__file__).resolve().parents[1]
LOWEST = REPO / ".venv" / "lowest-overlay"
REQUIREMENTS = REPO / "tests" / "lowest" / "requirements.txt"
# numpy's floor is the runtime's, tested in the Triton serving environment (no torch there); the exporters need 2,
# so the overlay holds the lowest numpy 2.
TRITON_REQUIREMENTS = REPO / "attncal" / "serving" / "requirements-triton.txt"
# What runs at the floors: the files whose subjects mirror a library, the cheap end of each.
SELECTION = ["tests/test_versions.py", "tests/test_tokenizer.py", "tests/test_quantize.py", "tests/test_fp16.py",
             "-k", "test_versions or test_tokenizer or equal_onnxruntime or cosine or refusals or converters_graph"]


def _requirements(path: Path) -> dict[str, str]:
    """name -> what follows it, of each requirement line in `path`."""
    out = {}
    for line in path.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)\s*([=<>!~].*)", line.strip())
        if match and not line.startswith("#"):
            out[match[1].lower()] = match[2].strip()
    return out


def _pins() -> dict[str, str]:
    return {name: spec.removeprefix("==") for name, spec in _requirements(REQUIREMENTS).items()}


def _floor(spec: str) -> Version:
    floors = [part.strip()[2:] for part in spec.split(",") if part.strip().startswith(">=")]
    assert floors, f"the range {spec!r} has no floor"
    return Version(floors[0])


def test_the_floors_are_the_declared_ones():
    """The overlay (and, for numpy, the Triton environment) holds the lowest release each range in pyproject.toml
    allows, so the two cannot drift apart."""
    declared = versions.declared_ranges()
    for name, version in _pins().items():
        if name == "numpy":
            assert _floor(declared["numpy"]) == _floor(_requirements(TRITON_REQUIREMENTS)["numpy"])
            assert Version(version).major == 2
        elif name in declared:
            assert _floor(declared[name]) == Version(version), (name, declared[name], version)


def test_version_sensitive_tests_pass_at_the_floors():
    if not all((LOWEST / f"{name.replace('-', '_')}-{version}.dist-info").exists() for name, version in _pins().items()):
        pytest.fail(f"lowest-versions overlay missing or stale at {LOWEST}: run `make test` (it installs "
                    f"{REQUIREMENTS.relative_to(REPO)})")
    # Not an xdist worker's variables: with PYTEST_XDIST_WORKER set, the inner run would take the shared caches
    # (conftest's raw exports, support.built_once) from beside its own temporary root, a folder every run shares.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")},
           "PYTHONPATH": str(LOWEST), "HF_HUB_OFFLINE": "1"}
    probe = subprocess.run([sys.executable, "-c", "import onnx, transformers, numpy, packaging; "
                            "print(onnx.__version__, transformers.__version__, numpy.__version__, packaging.__version__)"],
                           env=env, capture_output=True, text=True, cwd=REPO)
    pins = _pins()
    assert probe.stdout.split() == [pins["onnx"], pins["transformers"], pins["numpy"], pins["packaging"]], probe.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          *SELECTION], env=env, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    print(run.stdout.strip().splitlines()[-1])
