"""The simulator's kernels under ThreadSanitizer (opt-in: `make simt-tsan`, which sets SIMT_TSAN=1; skipped
otherwise, the build and the run take minutes).  The library is compiled with -fsanitize=thread, the runtime
included, and the mutation tests' probes (both calibration launchers, the tiled attention kernel in float16,
bfloat16 and float32, the per-row kernel) run in a subprocess with libtsan preloaded; the test passes when
ThreadSanitizer reports nothing.  The threads of a block are real threads, so a data race between them in the
kernel source (a missing __syncthreads) or in the runtime shows here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import build

pytestmark = [pytest.mark.simt,
              pytest.mark.skipif(os.environ.get("SIMT_TSAN") != "1", reason="opt-in: `make simt-tsan` runs it")]


@pytest.mark.parametrize("kind", ["calibration", "attention"])
def test_no_thread_sanitizer_reports(kind):
    lib = build.build(tsan=True)
    libtsan = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    tests = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(tests)!r}); from simt.test_simt_mutations import probe; "
            f"probe({str(lib)!r}, {kind!r})")
    env = dict(os.environ, LD_PRELOAD=libtsan, TSAN_OPTIONS="halt_on_error=0 exitcode=66 report_signal_unsafe=0",
               SIMT_TIMEOUT_S="600", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3000, env=env, cwd=tests)
    reports = r.stderr.count("WARNING: ThreadSanitizer")
    print(f"ThreadSanitizer, {kind} probe: {reports} report(s); {r.stdout.strip()}")
    assert reports == 0 and r.returncode == 0, r.stderr[-6000:]
