"""The CPU attention kernel alone on each model's attention shape, one or more kernel trees side by side.

Why: a model-level A/B (`library_ab.py`) shows what users get, but the op is a quarter to two thirds of a
model's time, and a shared VM drifts by more than a kernel change moves the model.  Here the kernel
(`plugins/kernels/cpu/calibrated_attention.h`) runs alone, one thread, uncalibrated, on the attention shapes of
the synthetic benchmark models (`benchmarks/attention_kernel.cpp` lists them); each tree is built into its own
program with the library's flags and OpenBLAS, and the programs run in turn, round by round, so that drift hits
every build alike.  Each run times the second of two calls, as a session's steady state: the first faults in the
memory that ORT's arena would keep.  Medians per build, the ratio to the first build, and whether the builds
computed the same bits (an output hash).

    # this checkout against an older commit's kernels
    git worktree add ../old-attncal COMMIT
    python benchmarks/attention_kernel.py --kernels old=../old-attncal/plugins/kernels \\
        --kernels new=plugins/kernels --rounds 5

    # what the calibration costs the op on one CPU path: uncalibrated against every row calibrated (mean pooling)
    ATTNCAL_CPU_PATH=avx2 python benchmarks/attention_kernel.py --shapes minilm-128,minilm-256,minilm-512 \\
        --poolings off,mean,cls --clock cpu --rounds 9

    # calibrated: the first token's row (cls) against a landmark per 128 tokens, side by side
    python benchmarks/attention_kernel.py --shapes xlmr-2048 --poolings cls,landmark --rounds 9

`--poolings` runs each build calibrated as named (attention_kernel.cpp: off, the default, is uncalibrated; mean;
cls; landmark), each pooling a column of its own, interleaved like the builds.  `--clock cpu` times each round by the
program's CPU time instead of the wall clock: on a machine shared with other jobs, the wall clock counts the time
they hold the core.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "benchmarks" / "attention_kernel.cpp"
SHAPES = ("xlmr-2048", "xlmr-8192", "minilm-128", "minilm-256", "minilm-512", "gemma-window", "gemma-global", "qwen3",
          "modernbert-window")
POOLINGS = ("off", "mean", "cls", "landmark")


def build(kernels: Path, out: Path) -> Path:
    """The benchmark program against the kernel tree `kernels`, with the library's flags and GEMM (OpenBLAS)."""
    import scipy_openblas32 as ob

    exe = out / "attention_kernel"
    subprocess.run(["g++", "-std=gnu++17", "-O3", "-DATTNCAL_GEMM_OPENBLAS", "-I", str(kernels),
                    "-I", ob.get_include_dir(), str(SOURCE), "-L", ob.get_lib_dir(), f"-l{ob.get_library()}",
                    f"-Wl,-rpath,{ob.get_lib_dir()}", "-o", str(exe)], check=True)
    return exe


CLOCKS = ("wall", "cpu")


def run(programs: dict[str, tuple[Path, str]], shapes: list[str], rounds: int, clock: str = "wall") -> list[dict]:
    """Per shape: median ms per column (a build and its pooling; rounds interleaved across columns) and whether
    every column's output hash was the same."""
    rows = []
    for shape in shapes:
        times: dict[str, list[float]] = {name: [] for name in programs}
        hashes: dict[str, set[str]] = {name: set() for name in programs}
        for _ in range(rounds):
            for name, (exe, pooling) in programs.items():
                # The second of two calls: the first faults in the program's memory, which ORT's arena keeps.
                out = subprocess.run([str(exe), shape, "2", pooling, clock], capture_output=True, text=True,
                                     check=True).stdout
                _, ms, digest = out.splitlines()[-1].split()
                times[name].append(float(ms))
                hashes[name].add(digest)
        medians = {name: statistics.median(t) for name, t in times.items()}
        first = next(iter(medians.values()))
        # Builds compute the same bits when every column of one pooling printed one hash.
        same = all(len(set().union(*(hashes[n] for n, (_, p) in programs.items() if p == pooling))) == 1
                   for pooling in {p for _, p in programs.values()})
        rows.append({"shape": shape, "ms": medians, "ratio": {n: m / first for n, m in medians.items()},
                     "same_bits": same})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", action="append", metavar="NAME=DIR",
                        help="a kernel tree (plugins/kernels of some checkout); repeat to compare; "
                             "default: this checkout's")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--poolings", default="off", help=f"comma-separated, of {', '.join(POOLINGS)}: each build "
                                                             "calibrated as named, a column each (default off)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="time a round by the wall clock (default) or by the program's CPU time")
    args = parser.parse_args(argv)
    if shutil.which("g++") is None:
        print("attention_kernel: g++ is needed to build the benchmark", file=sys.stderr)
        return 2
    trees: dict[str, Path] = {}
    for spec in args.kernels or [f"current={REPO / 'plugins' / 'kernels'}"]:
        name, sep, path = spec.partition("=")
        if not sep or not (Path(path) / "cpu" / "calibrated_attention.h").is_file():
            print(f"attention_kernel: {spec!r} is not NAME=DIR with DIR a kernel tree (cpu/calibrated_attention.h)",
                  file=sys.stderr)
            return 2
        trees[name] = Path(path)
    shapes = [s for s in args.shapes.split(",") if s]
    poolings = [p for p in args.poolings.split(",") if p]
    unknown = [s for s in shapes if s not in SHAPES]
    bad = [p for p in poolings if p not in POOLINGS] if poolings else ["(none)"]
    if unknown or bad or args.rounds < 1:
        print(f"attention_kernel: unknown shape(s) {unknown}" if unknown else
              f"attention_kernel: unknown pooling(s) {bad}; use {', '.join(POOLINGS)}" if bad else
              "attention_kernel: --rounds must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        programs, built = {}, {}
        for i, (name, tree) in enumerate(trees.items()):
            if tree.resolve() not in built:  # one program per distinct tree
                (Path(tmp) / str(i)).mkdir()
                built[tree.resolve()] = build(tree, Path(tmp) / str(i))
            for pooling in poolings:  # one column per build and pooling; the build's name alone when uncalibrated
                column = name if poolings == ["off"] else (pooling if len(trees) == 1 else f"{name} {pooling}")
                programs[column] = (built[tree.resolve()], pooling)
        rows = run(programs, shapes, args.rounds, args.clock)
    names = list(programs)
    header = ["shape", *(f"{n} ms" for n in names), *(f"{n} / {names[0]}" for n in names[1:]),
              "same bits per pooling" if poolings != ["off"] else "same bits"]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 2) + "---|")
    for r in rows:
        cells = [r["shape"], *(f"{r['ms'][n]:.1f}" for n in names), *(f"{r['ratio'][n]:.3f}" for n in names[1:]),
                 "yes" if r["same_bits"] else "no"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
