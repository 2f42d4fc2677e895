"""Paired bootstrap intervals for the README's eval tables (a helper script, not part of the package).

Reads the corpus and query embeddings that `attncal eval` cached for the run
(MODEL `default`, λ 0.5 and 1, basket 128, SEA with 128-token chunks), scores
every query, and resamples queries with replacement (2000 times, seed 0),
recomputing each config and the uncalibrated model on the same resample.
Prints the point difference against the uncalibrated model and its 95 %
percentile interval for HM, PSI and each group's nDCG@10.

    python docs/eval/bootstrap_ci.py DATA_DIR CACHE_DIR

It stops on a cache miss: run the `attncal eval ... --cache CACHE_DIR` command first.
"""

import statistics
import sys

import numpy as np

from attncal.calibration.config import CalibrationConfig
from attncal.eval import load_dataset
from attncal.eval.encoders import EncodeCache, TorchBackend, chunker_id
from attncal.eval.metrics import per_query
from attncal.eval.runner import _hash_texts, exact_search


def main(data_dir: str, cache_dir: str) -> None:
    data = load_dataset(data_dir)
    b = TorchBackend("default")
    cache = EncodeCache(cache_dir)

    def miss():
        raise SystemExit("cache miss: run attncal eval with the same data, model and --cache first")

    qids, dids, fp = data.query_ids(), list(data.corpus), data.fingerprint()
    q = cache.get_or_encode(b, None, _hash_texts([data.queries[x] for x in qids]), "queries", miss)
    embs = {"uncalibrated": cache.get_or_encode(b, None, fp, "corpus", miss)}
    for s in (0.5, 1.0):
        embs[f"λ={s:g}"] = cache.get_or_encode(b, CalibrationConfig(strength=s), fp, "corpus", miss)
    embs["SEA"] = cache.get_or_encode(b, None, fp, f"sea-{chunker_id()}-128", miss)
    qrels = {x: data.qrels[x] for x in qids}
    ndcg = {k: np.array([v[x]["ndcg10"] for x in qids])
            for k, v in ((k, per_query(qrels, exact_search(q, e, qids, dids, 100))) for k, e in embs.items())}
    group = np.array([data.group[x] for x in qids])

    def stats(v: np.ndarray, idx: np.ndarray) -> list[float]:
        means = [v[idx][group[idx] == g].mean() for g in data.groups]
        return [statistics.harmonic_mean(means), 1 - min(means) / max(means), *means]

    rng = np.random.default_rng(0)
    n = len(qids)
    samples = [rng.integers(0, n, n) for _ in range(2000)]
    names = ["ΔHM", "ΔPSI", *(f"Δ{g}" for g in data.groups)]
    for k in [k for k in embs if k != "uncalibrated"]:
        full = np.arange(n)
        point = np.subtract(stats(ndcg[k], full), stats(ndcg["uncalibrated"], full))
        d = np.array([np.subtract(stats(ndcg[k], i), stats(ndcg["uncalibrated"], i)) for i in samples])
        lo, hi = np.percentile(d, [2.5, 97.5], axis=0)
        print(f"{k:>6}: " + "  ".join(f"{nm} {p:+.3f} [{a:+.3f}, {z:+.3f}]" for nm, p, a, z in zip(names, point, lo, hi)))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
