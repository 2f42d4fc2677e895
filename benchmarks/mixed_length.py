"""Passages per second and peak memory on a mixed-length real-prose corpus: count batching, token-budget
batching and sentence-transformers on PyTorch.

The corpus is made here, not committed: `corpus` cuts the Python Language Reference (pydoc_data, in every
CPython) into passages of 20 to 500 tokens (the model's tokenizer counts them), their target lengths drawn
log-uniformly with a fixed seed, so most are short and a few long, as in a real index.  all-MiniLM-L6-v2 (the
default model) runs with its max length raised to 512 so no passage is truncated.

Each run is its own process (its peak RSS is its own, `getrusage`), 2 threads, the engines interleaved round by
round: load, encode 16 passages to warm up, then time one `encode` of the whole corpus.

* `attncal-count`: `Encoder.encode(texts, batch_size=32)`, sorted by length (what it did before token budgets);
* `attncal-tokens-B-C`: `Encoder.encode(texts, batch_size=C, max_batch_tokens=B)`;
* `st-torch`: sentence-transformers' `SentenceTransformer.encode(texts, batch_size=32)` on PyTorch (it sorts
  by length too).

    attncal export default -o W/minilm --no-calibrate
    python benchmarks/mixed_length.py --export W/minilm --n 600 --rounds 3 --json W/mixed.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SEED = 0
MIN_TOKENS, MAX_TOKENS = 20, 500
MAX_LENGTH = 512
THREADS = 2
ENGINES = ("attncal-count", "attncal-tokens-16384-256", "attncal-tokens-8192-256", "st-torch")

CHILD = r"""
import json, os, resource, sys, time
engine, export, corpus, threads, max_length = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
texts = json.loads(open(corpus, encoding="utf-8").read())
if engine == "st-torch":
    import torch
    from sentence_transformers import SentenceTransformer
    from attncal.modelinfo import default_model_path
    torch.set_num_threads(threads)
    model = SentenceTransformer(str(default_model_path()), device="cpu")
    model.max_seq_length = max_length
    run = lambda t: model.encode(t, batch_size=32)
else:
    from attncal.runtime import Encoder
    enc = Encoder(export, intra_op_threads=threads)
    enc.max_length = max_length
    if engine == "attncal-count":
        run = lambda t: enc.encode(t, batch_size=32)
    else:
        budget, cap = map(int, engine.split("-")[2:])
        run = lambda t: enc.encode(t, batch_size=cap, max_batch_tokens=budget)
run(texts[:16])
loaded = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
t0 = time.perf_counter()
emb = run(texts)
wall = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"engine": engine, "passages": len(texts), "seconds": wall, "passages_per_s": len(texts) / wall,
                  "peak_rss_mib": peak / 2**20, "rss_after_warmup_mib": loaded / 2**20, "dim": int(emb.shape[1])}))
"""


def make_corpus(n: int, seed: int = SEED) -> list[str]:
    """`n` passages of MIN_TOKENS..MAX_TOKENS tokens (the default model's tokenizer, special tokens included),
    consecutive words of the Python Language Reference topics, target lengths log-uniform."""
    from transformers import AutoTokenizer

    from attncal.eval.realtext import python_reference_documents
    from attncal.modelinfo import default_model_path

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    words = [w for d in python_reference_documents()[0] for w in d.text.split()]
    rng = np.random.default_rng(seed)
    out, pos = [], 0
    while len(out) < n:
        target = int(np.exp(rng.uniform(np.log(MIN_TOKENS), np.log(MAX_TOKENS))))
        take = max(5, int(target / 1.4))  # about 1.4 tokens a word in this prose
        if pos + take > len(words):
            pos = 0
        text = " ".join(words[pos:pos + take])
        pos += take
        ids = tok(text, truncation=True, max_length=MAX_TOKENS)["input_ids"]
        if len(ids) >= MIN_TOKENS:
            out.append(tok.decode(ids[1:-1]) if len(ids) == MAX_TOKENS else text)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", required=True, help="an attncal export of the default model")
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = (args.json.parent if args.json else Path(".")).resolve()
    corpus = work / "mixed-corpus.json"
    texts = make_corpus(args.n)
    corpus.write_text(json.dumps(texts), encoding="utf-8")
    engines = args.engines.split(",")
    runs = {e: [] for e in engines}
    for r in range(args.rounds):
        for e in engines[r % len(engines):] + engines[:r % len(engines)]:  # rotating order
            out = subprocess.run([sys.executable, "-c", CHILD, e, args.export, str(corpus), str(THREADS),
                                  str(MAX_LENGTH)], capture_output=True, text=True, check=True)
            runs[e].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[e][-1]), flush=True)
    summary = {}
    for e, rs in runs.items():
        summary[e] = {"passages_per_s": float(np.median([x["passages_per_s"] for x in rs])),
                      "peak_rss_mib": float(np.median([x["peak_rss_mib"] for x in rs])),
                      "rss_after_warmup_mib": float(np.median([x["rss_after_warmup_mib"] for x in rs]))}
    base = summary.get("attncal-count", {}).get("passages_per_s")
    st = summary.get("st-torch", {}).get("passages_per_s")
    for s in summary.values():
        s["vs_attncal_count"] = s["passages_per_s"] / base if base else None
        s["vs_st_torch"] = s["passages_per_s"] / st if st else None
    lengths = [len(t.split()) for t in texts]
    result = {"passages": len(texts), "words": {"min": min(lengths), "median": float(np.median(lengths)),
                                                 "max": max(lengths)},
              "threads": THREADS, "rounds": args.rounds, "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
