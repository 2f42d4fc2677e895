"""Measuring position bias and the retrieval effect of a calibration config.

`load_dataset` reads position-labelled retrieval data (FineWeb-PosQ or
PosIR/BEIR layout), `evaluate` encodes, searches and scores a list of configs
(nDCG@10 per position group, harmonic mean, PSI, deltas against the
uncalibrated model), `write_synthetic` builds a small position-controlled set.
"""

from .data import Dataset, DataError, load_dataset
from .metrics import GroupScores, group_scores, harmonic_mean, psi
from .runner import EvalOptions, evaluate, exact_search
from .synthetic_set import make_passages, write_synthetic

__all__ = [
    "DataError", "Dataset", "EvalOptions", "GroupScores", "evaluate", "exact_search", "group_scores",
    "harmonic_mean", "load_dataset", "make_passages", "psi", "write_synthetic",
]
