"""The simulator's kernels under ThreadSanitizer (opt-in: `make simt-tsan`, which sets SIMT_TSAN=1; skipped
otherwise, the build and the run take minutes).  The library is compiled with -fsanitize=thread, the runtime
included, and the mutation tests' probes (both calibration launchers, the tiled attention kernel in float16,
bfloat16 and float32, the per-row kernel) run in a subprocess with libtsan preloaded; the test passes when
ThreadSanitizer reports nothing.  The threads of a block are real threads, so a data race between them in the
kernel source (a missing __syncthreads) or in the runtime shows here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from . import build

pytestmark = [pytest.mark.simt,
              pytest.mark.skipif(os.environ.get("SIMT_TSAN") != "1", reason="opt-in: `make simt-tsan` runs it")]


def run_under_tsan(lib: Path, kind: str) -> tuple[int, subprocess.CompletedProcess]:
    """(ThreadSanitizer's reports, the run) of the mutation tests' probe `kind` on the TSan-built library `lib`."""
    libtsan = subprocess.run(["g++", "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    tests = Path(__file__).resolve().parents[1]
    code = (f"import sys; sys.path.insert(0, {str(tests)!r}); from simt.test_simt_mutations import probe; "
            f"probe({str(lib)!r}, {kind!r})")
    # SIMT_CPU=none: the block's threads on every CPU, preempting each other across cores (the suite pins them
    # to one CPU, where a thread switches only where it blocks or its time slice ends).
    env = dict(os.environ, LD_PRELOAD=libtsan, TSAN_OPTIONS="halt_on_error=0 exitcode=66 report_signal_unsafe=0",
               SIMT_TIMEOUT_S="600", OMP_NUM_THREADS="1", SIMT_CPU="none")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3000, env=env, cwd=tests)
    return r.stderr.count("WARNING: ThreadSanitizer"), r


@pytest.mark.parametrize("kind", ["calibration", "attention"])
def test_no_thread_sanitizer_reports(kind):
    reports, r = run_under_tsan(build.build(tsan=True), kind)
    print(f"ThreadSanitizer, {kind} probe: {reports} report(s); {r.stdout.strip()}")
    assert reports == 0 and r.returncode == 0, r.stderr[-6000:]


def test_thread_sanitizer_sees_a_missing_syncthreads(tmp_path):
    """The planted bug of the mutation tests (a __syncthreads removed from calibrate_kernel): ThreadSanitizer
    reports the race between the thread that writes the row's scalars and the threads that read them."""
    from .test_simt_mutations import MUTANTS

    path, old, new, _, kind = MUTANTS["calibration_syncthreads_removed"]
    kernels = tmp_path / "kernels"
    shutil.copytree(build.KERNELS, kernels, ignore=shutil.ignore_patterns("cpu"))
    src = kernels / "cuda" / path
    src.write_text(src.read_text().replace(old, new))
    reports, r = run_under_tsan(build.build(kernels, tsan=True), kind)
    print(f"ThreadSanitizer on the mutant: {reports} report(s)")
    assert reports > 0 and "data race" in r.stderr, r.stderr[-3000:]
