"""What a user gets by default: `Encoder(out).encode` on default exports, calibrated vs uncalibrated.

Both exports are made with default options (`attncal export default -o ...`, placement auto), so the
Encoder picks the same graph a user's code would (the ORT-optimized graph where the export has one).
Texts are about `--tokens` tokens long; the two encoders run interleaved and the ratio of median
wall times is reported.

    python benchmarks/default_encoder.py [--texts 48] [--tokens 256] [--rounds 5] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", default=None, help="where the two exports are cached (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--calibrated-first", action="store_true",
                    help="create the calibrated session first (in one process the first ONNX Runtime session "
                         "created can run slower than later ones: run both orders and compare)")
    args = ap.parse_args()

    from attncal.export.exporter import ExportOptions, export
    from attncal.modelinfo import default_model_path
    from attncal.runtime import Encoder

    work = Path(args.workdir or tempfile.mkdtemp(prefix="attncal-default-"))
    outs = {}
    for name, cal in (("uncalibrated", False), ("calibrated", True)):
        outs[name] = work / name
        if not (outs[name] / "attncal.json").exists():
            export(default_model_path(), outs[name], ExportOptions(calibrate=cal, overwrite=True), quiet=True)
    order = ["calibrated", "uncalibrated"] if args.calibrated_first else ["uncalibrated", "calibrated"]
    encs = {n: Encoder(outs[n], intra_op_threads=args.threads) for n in order}
    sentence = "Dense retrieval encodes each passage of a collection into one vector for nearest-neighbour search. "
    words = (sentence * (args.tokens // 8 + 10)).split()
    tok = encs["uncalibrated"].tokenizer
    texts = []
    for i in range(args.texts):
        target = max(8, args.tokens - 24 + (i % 7) * 8)  # ~tokens +- 24, mixed lengths
        n = target
        text = " ".join(words[:n])
        while len(tok(text)["input_ids"]) > target and n > 2:
            n -= 2
            text = " ".join(words[:n])
        texts.append(text)
    lengths = [len(tok(t)["input_ids"]) for t in texts]
    for e in encs.values():
        e.encode(texts)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in encs}
    for _ in range(args.rounds):
        for n, e in encs.items():
            t0 = time.perf_counter()
            e.encode(texts)
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    res = {
        "texts": len(texts), "median_tokens": statistics.median(lengths), "rounds": args.rounds,
        "threads": args.threads, "session_order": order, "graphs": {n: e.graph_file for n, e in encs.items()},
        "placement": json.loads((outs["calibrated"] / "attncal.json").read_text())["graphs"],
        "median_s": med, "ratio": med["calibrated"] / med["uncalibrated"],
    }
    for g in res["placement"].values():
        g.pop("parity", None)
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    sys.exit(main())
