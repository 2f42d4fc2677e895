"""fp16 exports on a GPU through ONNX Runtime: parity of every graph `attncal export --fp16` writes, and the
time of the default Encoder, calibrated vs uncalibrated (section 8 of benchmarks/gpu_check.py).

Two fp16 exports of the model (calibrated and not, default options) are made once in `--workdir`.  Then,
on `--provider` (CUDAExecutionProvider, from onnxruntime-gpu; the attncal library's CUDA kernels run the
attncal ops where it was built with nvcc):

* every graph of the calibrated export (portable, ORT-optimized, native) against the fp32 PyTorch
  reference with the fp16 tolerances of `attncal check` (attncal.runtime.parity.TOLERANCES);
* `Encoder(out).encode` on `--texts` texts of about `--tokens` tokens, calibrated and uncalibrated
  interleaved over `--rounds` rounds: the ratio of median times (the graph each Encoder picks is
  recorded).

Where the provider is not available (onnxruntime without CUDA), the section says so and measures nothing.
The same code runs on CPUExecutionProvider (the tests do, on a tiny model), so what a GPU run reports is
what this file computes.

    python benchmarks/fp16_exports.py [--model default] [--workdir DIR] [--provider CUDAExecutionProvider]
                                      [--texts 64] [--tokens 256] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_encoder import make_texts  # noqa: E402


def run(model: str | Path, workdir: str | Path, provider: str = "CUDAExecutionProvider", texts: int = 64,
        tokens: int = 256, rounds: int = 5) -> dict:
    """The section's results as a dict; {"skipped": why} where `provider` is not available."""
    import onnxruntime as ort

    from attncal.bench.timing import interleaved_times, medians
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime import Encoder
    from attncal.runtime.parity import check_parity

    available = ort.get_available_providers()
    if provider not in available:
        return {"skipped": f"{provider} is not available in onnxruntime {ort.__version__} (providers: "
                           f"{', '.join(available)}); onnxruntime-gpu provides CUDAExecutionProvider"}
    providers = [provider] + (["CPUExecutionProvider"] if provider != "CPUExecutionProvider" else [])
    work = Path(workdir)
    outs = {}
    for name, calibrate in (("calibrated", True), ("uncalibrated", False)):
        outs[name] = work / f"fp16-{name}"
        if not (outs[name] / "attncal.json").exists():
            export(model, outs[name], ExportOptions(calibrate=calibrate, fp16=True, overwrite=True), quiet=True)
    meta = json.loads((outs["calibrated"] / "attncal.json").read_text())
    res: dict = {"provider": provider, "parity": {}}
    cache: dict = {}
    for graph in meta["graphs"]:
        rep = check_parity(outs["calibrated"], providers=providers, graph=graph, reference_cache=cache)
        res["parity"][graph] = {"placement": meta["graphs"][graph].get("placement"), "max_abs": rep.max_abs,
                                "min_cos": rep.min_cos, "tol_max_abs": rep.tol_max_abs, "ok": rep.ok}
    encs = {n: Encoder(o, providers=providers) for n, o in outs.items()}
    sample = make_texts(encs["uncalibrated"].tokenizer, texts, tokens)
    # one warm-up run each: the CUDA context, cuBLAS handles, the arena
    med = medians(interleaved_times({n: partial(e.encode, sample) for n, e in encs.items()}, rounds))
    res.update({"graphs": {n: e.graph_file for n, e in encs.items()}, "texts": texts, "tokens": tokens,
                "rounds": rounds, "median_s": med, "ratio": med["calibrated"] / med["uncalibrated"],
                "parity_ok": all(p["ok"] for p in res["parity"].values())})
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="model directory or 'default' (all-MiniLM-L6-v2)")
    ap.add_argument("--workdir", default=None,
                    help="where the two exports are made once (default: a temp dir, removed on exit)")
    ap.add_argument("--provider", default="CUDAExecutionProvider")
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    for name in ("texts", "tokens", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    from attncal.modelinfo import default_model_path, resolve_model_path

    model = default_model_path() if args.model == "default" else resolve_model_path(args.model)
    with contextlib.ExitStack() as stack:
        # Without --workdir the two exports live in a temp dir removed on exit, even on error.
        work = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="attncal-fp16-"))
        res = run(model, work, args.provider, args.texts, args.tokens, args.rounds)
    print(json.dumps(res, indent=2))
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=2))
        tmp.replace(args.json)
    return 0 if res.get("parity_ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
