"""Export deployed models' real sizes with random weights, and report each step's time and peak memory.

    python benchmarks/large_export.py --model bge-m3 --work /path/with/space [--json results/large-bge-m3.json]

Models (random weights, attncal's synthetic tokenizer: what is measured is the size, not the weights):
  bge-m3       XLM-R large: 24 layers, hidden 1024, 16 heads, 250,002 vocabulary, 8,194 positions, CLS pooling
  qwen3-0.6b   Qwen3-Embedding-0.6B: 28 layers, hidden 1024, 16 query / 8 KV heads of 128, 151,669 vocabulary,
               32k positions, last-token pooling
  ci           250,002 x 256 vocabulary, 2 layers (the size tests/test_large_export.py holds to its budget)

`attncal export` runs as a child process; the resident memory of it and its children is sampled every 10 ms
and the peak kept per step (the step lines it prints).  Then the export is loaded by the Encoder and
`attncal encode` runs a small corpus through it.  Peaks are given in MiB and in float32 weight sizes above
the interpreter's libraries (measured in a fresh interpreter importing them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attncal.memory import MIB, TreeSampler, available_bytes, interpreter_rss  # noqa: E402

MODELS = {
    "bge-m3": dict(arch="xlm-roberta", layers=24, hidden=1024, heads=16, intermediate=4096, max_positions=8192,
                   vocab=250002, pooling="cls"),
    "qwen3-0.6b": dict(arch="qwen3", layers=28, hidden=1024, heads=16, intermediate=3072, max_positions=32768,
                       vocab=151669, head_dim=128, pooling="last"),
    "ci": dict(arch="xlm-roberta", layers=2, hidden=256, heads=4, intermediate=1024, max_positions=8192,
               vocab=250002, pooling="cls"),
}


def build(name: str, dest: Path) -> Path:
    from attncal.synthetic import save_synthetic_model

    if (dest / "config.json").exists():
        return dest
    spec = dict(MODELS[name])
    return save_synthetic_model(spec.pop("arch"), dest, **spec)


def run_export(src: Path, out: Path, extra: list[str]) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "attncal", "export", str(src), "-o", str(out), "--overwrite", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    starts: dict[str, float] = {}
    with TreeSampler(proc.pid, interval=0.01) as sampler:
        for line in proc.stderr:
            sys.stderr.write(line)
            m = re.match(r"attncal: \[(\d)/4\] (.*)", line)
            if m:
                label = f"[{m.group(1)}/4] {m.group(2)[:60]}"
                sampler.mark(label)
                starts[label] = time.perf_counter() - t0
        proc.wait()
    total = time.perf_counter() - t0
    labels = list(starts)
    steps = [{"step": k, "seconds": round((starts[labels[i + 1]] if i + 1 < len(labels) else total) - starts[k], 1),
              "peak_rss_mib": round(sampler.peaks.get(k, 0) / MIB, 1)} for i, k in enumerate(labels)]
    return {"command": " ".join(cmd[2:]), "returncode": proc.returncode, "seconds": round(total, 1), "steps": steps,
            "stdout": proc.stdout.read()}


def run_encode(export: Path, work: Path, texts: list[str], expected) -> dict:
    """`attncal encode` of a small corpus through the export; its embeddings against the Encoder's."""
    import numpy as np

    from attncal.corpus import read_embeddings

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "attncal", "encode", str(export), "--input", str(corpus), "--output",
                           str(work / "embeddings"), "--quiet"], capture_output=True, text=True, env=env)
    res = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1), "rows": len(texts)}
    if proc.returncode == 0:
        _, got = read_embeddings(work / "embeddings")
        res["max_abs_vs_encoder"] = float(np.abs(got[:len(expected)] - expected).max())
    else:
        res["stderr_tail"] = proc.stderr[-500:]
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--work", type=Path, required=True, help="folder for the source model and the export")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("export_args", nargs="*", help="extra `attncal export` options, after --")
    a = p.parse_args()
    from attncal.memory import float32_weight_bytes

    src = build(a.model, a.work / f"{a.model}-src")
    weights = float32_weight_bytes(src)
    base = interpreter_rss()
    res = run_export(src, a.work / f"{a.model}-export", a.export_args)
    res.update(model=a.model, float32_weights_mib=round(weights / MIB, 1), library_rss_mib=round(base / MIB, 1),
               available_mib_at_start=round((available_bytes() or 0) / MIB, 1))
    for s in res["steps"]:
        s["weights_above_libraries"] = round((s["peak_rss_mib"] * MIB - base) / weights, 2)
    out = a.work / f"{a.model}-export"
    if res["returncode"] == 0:
        meta = json.loads((out / "attncal.json").read_text())
        res["files_mib"] = {str(f.relative_to(out)): round(f.stat().st_size / MIB, 1)
                            for f in sorted((out / "onnx").iterdir())}
        res["parity"] = {g: {k: v["parity"].get(k) for k in ("max_abs", "max_tokens", "length_cap", "batch_sizes")}
                         for g, v in meta["graphs"].items() if v.get("parity")}
        res["export_steps_recorded"] = meta.get("export_steps")
        from attncal.runtime.encoder import Encoder

        texts = ["a passage to embed", "another, longer passage to embed " * 20]
        t = time.perf_counter()
        emb = Encoder(out).encode(texts)
        res["encoder"] = {"seconds": round(time.perf_counter() - t, 1), "shape": list(emb.shape)}
        res["attncal_encode"] = run_encode(out, a.work / f"{a.model}-corpus", texts * 8, emb)
    print(json.dumps({k: v for k, v in res.items() if k != "stdout"}, indent=2))
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=2))
    return 0 if res["returncode"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
