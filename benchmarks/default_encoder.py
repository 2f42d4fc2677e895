"""What a user gets by default: `Encoder(out).encode` on default exports, calibrated vs uncalibrated.

Both exports are made with default options (`attncal export default -o ...`, placement auto), so the
Encoder picks the same graph a user's code would (the ORT-optimized graph where the export has one).
Texts are about `--tokens` tokens long; the two encoders run interleaved and the ratio of median
wall times is reported. Their sessions stop ORT's thread spinning when a run returns
(attncal.bench.engines.interleaved_session_options), as `attncal bench`'s do.

    python benchmarks/default_encoder.py [--texts 48] [--tokens 256] [--rounds 5] [--workdir DIR] [--json out.json]
                                         [--int8]

`--int8` adds `attncal export --quantize int8` of both (ratios to the fp32 uncalibrated Encoder, which users
would otherwise run) and the cosine between int8 and fp32 calibrated embeddings of real prose (the Python
Language Reference passages of `attncal eval --make-posq-example pyref`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", default=None, help="where the two exports are cached (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--int8", action="store_true", help="also time int8 exports and report the int8 cosine")
    ap.add_argument("--calibrated-first", action="store_true",
                    help="create the calibrated session first (in one process the first ONNX Runtime session "
                         "created can run slower than later ones: run both orders and compare)")
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        # Without --workdir the exports (~430 MB) live in a temp dir removed on exit, even on error.
        work = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="attncal-default-")))
        res = _run(args, work)
    print(json.dumps(res, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


def _run(args: argparse.Namespace, work: Path) -> dict:
    from attncal.bench.engines import interleaved_session_options
    from attncal.bench.timing import interleaved_times, medians
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.modelinfo import default_model_path
    from attncal.runtime import Encoder

    outs = {}
    variants = [("uncalibrated", False, None), ("calibrated", True, None)]
    if args.int8:
        variants += [("uncalibrated-int8", False, "int8"), ("calibrated-int8", True, "int8")]
    for name, cal, quant in variants:
        outs[name] = work / name
        if not (outs[name] / "attncal.json").exists():
            export(default_model_path(), outs[name], ExportOptions(calibrate=cal, overwrite=True, quantize=quant),
                   quiet=True)
    order = [v[0] for v in variants]
    if args.calibrated_first:
        order = order[1::2] + order[0::2]
    # Two sessions in one process, run in turn: each stops spinning when its run returns, or its idle workers
    # would take cores from the other's tokenization and run (a user's one Encoder has no such neighbour).
    encs = {n: Encoder(outs[n], intra_op_threads=args.threads, session_options=interleaved_session_options(outs[n]))
            for n in order}
    tok = encs["uncalibrated"].tokenizer
    texts = make_texts(tok, args.texts, args.tokens)
    lengths = [len(tok(t)["input_ids"]) for t in texts]
    med = medians(interleaved_times({n: partial(e.encode, texts) for n, e in encs.items()}, args.rounds))
    res = {
        "texts": len(texts), "median_tokens": statistics.median(lengths), "rounds": args.rounds,
        "threads": args.threads, "session_order": order, "graphs": {n: e.graph_file for n, e in encs.items()},
        "placement": json.loads((outs["calibrated"] / "attncal.json").read_text())["graphs"],
        "median_s": med, "ratio": med["calibrated"] / med["uncalibrated"],
        "ratios_to_fp32_uncalibrated": {n: med[n] / med["uncalibrated"] for n in med},
    }
    if args.int8:
        res["int8_cosine_real_prose"] = _int8_cosine(encs)
    for g in res["placement"].values():
        g.pop("parity", None)
    return res


def make_texts(tokenizer, count: int, tokens: int) -> list[str]:
    """`count` English texts of about `tokens` tokens (+- 24, mixed lengths) under `tokenizer`."""
    sentence = "Dense retrieval encodes each passage of a collection into one vector for nearest-neighbour search. "
    words = (sentence * (tokens // 8 + 10)).split()
    texts = []
    for i in range(count):
        target = max(8, tokens - 24 + (i % 7) * 8)
        n = target
        text = " ".join(words[:n])
        while len(tokenizer(text)["input_ids"]) > target and n > 2:
            n -= 2
            text = " ".join(words[:n])
        texts.append(text)
    return texts


def _int8_cosine(encs: dict) -> dict:
    """Cosine between int8 and fp32 calibrated embeddings of real prose passages (p1, p50, min)."""
    import numpy as np

    from attncal.eval.realtext import python_reference_documents

    docs, _ = python_reference_documents()
    passages = [d.text for d in docs][:256]
    a = encs["calibrated-int8"].encode(passages)
    b = encs["calibrated"].encode(passages)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"passages": len(passages), "p1": float(np.percentile(cos, 1)), "p50": float(np.median(cos)),
            "min": float(cos.min())}


if __name__ == "__main__":
    sys.exit(main())
