"""A whole export, opened and validated: `open_export` checks attncal.json, the model files, onnx/ and the
graphs asked for, and returns an `ExportDir`; every reader (the runtime, the exporter's parity check, serving,
bench, eval, the CLI) opens an export through it, so a damaged one is reported the same way everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .checks import check_export_file, check_model_files
from .layout import graph_files
from .metadata import read_metadata
from .onnx_io import load_onnx_checked


@dataclass(frozen=True)
class ExportDir:
    """A validated export directory."""

    path: Path
    meta: dict

    @property
    def graphs(self) -> list[str]:
        return graph_files(self.meta)

    @property
    def requires_digest(self) -> bool:
        return int(self.meta["format"]) >= 2

    def check_graph(self, rel: str, interface: bool = True):
        """Parse and verify one graph of the export; returns the ModelProto (weights not copied out)."""
        check_export_file(self.path / rel, self.path, "ONNX graph")
        return load_onnx_checked(self.path / rel, interface=interface, require_digest=self.requires_digest,
                                 expected_inputs=self.meta.get("inputs"))


def open_export(out_dir: str | os.PathLike, *, graphs: Iterable[str] | str | None = "all") -> ExportDir:
    """Validate export `out_dir`: attncal.json, model files, onnx/ and the graphs named by `graphs`
    ("all": every graph attncal.json lists, None: none). Raises ArtifactError naming what is wrong."""
    meta = read_metadata(out_dir)
    exp = ExportDir(Path(out_dir), meta)
    check_model_files(exp.path, meta)
    for rel in (exp.graphs if graphs == "all" else [graphs] if isinstance(graphs, str) else graphs or []):
        exp.check_graph(rel)
    return exp
