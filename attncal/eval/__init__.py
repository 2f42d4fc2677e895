"""Measuring position bias and the retrieval effect of a calibration config.

`load_dataset` reads position-labelled retrieval data (FineWeb-PosQ or
PosIR/BEIR layout), `evaluate` encodes, searches and scores a list of configs
(nDCG@10 per position group, harmonic mean, PSI, deltas against the
uncalibrated model), `write_synthetic` builds a small position-controlled set,
`make_posq` builds a position-labelled set from a user's own documents,
`python_reference_documents` gives the real-prose example corpus and `make_posq_example` the set
built from it,
`compare_exports` reports the retrieval drift between attncal exports, and
`tune` sweeps a grid of configs on a user's documents and recommends one (or none).

`tune` is also the name of the submodule `attncal.eval.tune`, which the function shadows as an attribute of
this package: reach the module with `from attncal.eval.tune import ...` or `importlib.import_module`.
"""

from .compare import CompareOptions, compare_exports
from .data import Dataset, DataError, load_dataset
from .posq_builder import Document, PosqOptions, build_posq, make_posq, write_posq
from .metrics import GroupScores, group_scores, harmonic_mean, psi
from .runner import EvalOptions, evaluate, exact_search
from .realtext import make_posq_example, python_reference_documents
from .synthetic_set import make_passages, write_synthetic
from .tune import TuneOptions, tune

__all__ = [
    "CompareOptions", "DataError", "Dataset", "Document", "EvalOptions", "PosqOptions", "build_posq", "make_posq",
    "compare_exports", "make_posq_example",
    "python_reference_documents", "write_posq", "GroupScores", "evaluate", "exact_search", "group_scores",
    "harmonic_mean", "load_dataset", "make_passages", "psi", "write_synthetic", "TuneOptions", "tune",
]
