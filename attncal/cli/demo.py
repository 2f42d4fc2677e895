"""The main job on the embedded default model, all-MiniLM-L6-v2: export it calibrated and uncalibrated.

Then show on real prose whether calibration finds passages by their late parts (`demo_position`), check both
exports against PyTorch and compare their cost."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

from ..artifact import pooling_of
from ..bench.engines import interleaved_session_options
from ..bench.timing import interleaved_times, medians
from ..exporting.plan import ExportOptions
from ..runtime import Encoder
from ..runtime.encoder import graph_has_custom_op
from ..runtime.oplib import resolve_library
from . import demo_position
from .common import add_calibration_args, config_from_args

LOG_FILE_HELP = "each export keeps them in its attncal-export.log"

DEMO_TEXTS = [
    "Attention calibration is applied at indexing time.",
    "The pooling token of an encoder attends mostly to the start of a passage. " * 4,
    " ".join(
        f"Paragraph {i} of a long passage: dense retrievers compress every passage into a single vector, "
        "and facts near the end tend to be under-represented in it." for i in range(12)
    ),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="model directory or cached hub id (default: the embedded all-MiniLM-L6-v2)")
    p.add_argument("--out", default="demo-out", help="where the two exports are written (default %(default)s)")
    p.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo",
                   help="torch.onnx exporter of both exports (default %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per model for the latency figures")
    p.add_argument("--native", action=argparse.BooleanOptionalAction, default=None,
                   help="run the calibration op with the attncal native library (default: when built, "
                        "unless ATTNCAL_NATIVE=0; --native requires it, --no-native uses the function body)")
    p.add_argument("--no-position-eval", action="store_true",
                   help="skip the retrieval comparison on real prose (the Python Language Reference)")
    add_calibration_args(p)


def _latency_ms(encoders: dict, feeds_by_name: dict, repeats: int) -> dict[str, float]:
    """Median latency per model, runs interleaved so both see the same machine state."""
    runs = {k: partial(enc.run, feeds_by_name[k]) for k, enc in encoders.items()}
    return medians(interleaved_times(runs, repeats, warmup=3), scale=1e3)


def _op_path(library) -> str:
    """What the calibrated timing measured, in words."""
    if library is not None:
        return f"the attncal native kernel ({library})"
    return "the ONNX function body (standard ops; `make plugins` builds the native kernel)"


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    library = resolve_library(getattr(args, "native", None))  # before the exports: --native may refuse
    config = config_from_args(args)
    out = Path(args.out)
    dirs = {"uncalibrated": out / "uncalibrated", "calibrated": out / "calibrated"}
    from ..exporting.exporter import export  # lazy: onnx_ir and sympy, not loaded at start-up

    metas = {}
    for name, path in dirs.items():
        print(f"== export {name} -> {path}", file=sys.stderr, flush=True)
        metas[name] = export(
            args.model, path,
            ExportOptions(config=config, calibrate=name == "calibrated", exporter=args.exporter, overwrite=True),
        )
    meta = metas["calibrated"]
    print()
    print(f"model      {meta['source_model']}")
    print(f"config     {config.variant}, λ={config.strength}, basket={config.basket_size}, "
          f"layers={meta['calibrated_layers']} of {meta['num_layers']}, pooling={pooling_of(meta).describe()}")
    if not args.no_position_eval:
        print("== scoring both exports on real prose", file=sys.stderr, flush=True)
        data, source = demo_position.build_set(out / "posq-example", dirs["calibrated"])
        results = demo_position.compare(dirs["uncalibrated"], dirs["calibrated"], data)
        print()
        print(demo_position.report(results, source))
    print()
    print("parity of each ONNX export vs PyTorch (attncal check, built-in texts):")
    for name, m in metas.items():
        p = m["parity"]
        print(f"  {name:<13} max |Δ| {p['max_abs']:.2e}   min cosine {p['min_cos']:.8f}   "
              f"{'OK' if p['ok'] else 'FAILED'} (tolerance {p['tol_max_abs']:g})")
    # Both sessions get the same options; the library only changes the calibrated graph's op.  They are timed
    # in turn, so each stops spinning when its run returns (as `attncal bench`'s engines do).
    encoders = {k: Encoder(v, providers=["CPUExecutionProvider"], custom_op_library=library,
                           native=None if library is not None else False,
                           session_options=interleaved_session_options(v))
                for k, v in dirs.items()}
    embs = {k: e.encode(DEMO_TEXTS) for k, e in encoders.items()}
    feeds = {k: e.tokenize(DEMO_TEXTS) for k, e in encoders.items()}
    lat = _latency_ms(encoders, feeds, args.repeats)
    n_tokens = feeds["calibrated"]["attention_mask"].sum(1)
    print()
    print(f"{'tokens':>6}  {'cosine(cal, uncal)':>18}  {'max |Δ|':>9}  text")
    for text, n, a, b in zip(DEMO_TEXTS, n_tokens, embs["uncalibrated"], embs["calibrated"]):
        cos = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        print(f"{int(n):>6}  {cos:>18.6f}  {np.abs(a - b).max():>9.2e}  {text[:48]!r}")
    print()
    print(f"ONNX Runtime CPU latency, batch of {len(DEMO_TEXTS)} texts (median of {args.repeats}, interleaved): "
          f"uncalibrated {lat['uncalibrated']:.2f} ms, calibrated {lat['calibrated']:.2f} ms "
          f"(ratio {lat['calibrated'] / lat['uncalibrated']:.3f})")
    cal = encoders["calibrated"]
    placement = (cal.meta.get("graphs") or {}).get(cal.graph_file, {}).get("placement") or cal.meta.get("placement")
    print(f"calibrated graph: {cal.graph_file}, {placement} placement")
    if graph_has_custom_op(cal.meta, cal.graph_file):
        print(f"calibration op ran as: {_op_path(library)}")
    else:
        print("calibration ran as: attention over baskets in fused MultiHeadAttention (no custom op, no "
              "[B,H,S,S] probabilities)")
    print("texts with less than one basket of content are not calibrated (skip_short); differences of ~1e-7 "
          "there are float rounding between two graphs.")
    return 0
