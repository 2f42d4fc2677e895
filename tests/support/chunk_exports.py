"""Tiny exports the chunking and precision tests share (built once per run, `built_once`): a calibrated
mean-pooled BERT and an uncalibrated one of the same model (max length 64, so texts of a few hundred characters
take several windows), and an LMK export every 8 tokens.  Every one but the uncalibrated BERT has chunk vectors
in its graphs (`--chunk-vectors`), so late and landmark chunks are computed in the graph there and from the
token states in the uncalibrated BERT, as in an export made without the option."""

from __future__ import annotations

from pathlib import Path

from .built_once import built_once

MAX_LENGTH = 64
CALIBRATION = dict(basket_size=4, strength=1.0)  # basket 4: calibration changes rows of a few dozen tokens


def _build(path: Path, arch: str, pooling: str | None, calibrate: bool, every: int | str | None) -> None:
    from attncal.calibration.config import CalibrationConfig
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.pooling import Pooling
    from attncal.synthetic import save_synthetic_model

    model = save_synthetic_model(arch, path / "model", seed=3, pooling=pooling, max_positions=128,
                                 max_seq_length=MAX_LENGTH)
    config = CalibrationConfig(**CALIBRATION, pooling=Pooling("lmk", every) if every else Pooling())
    export(str(model), path / "export", ExportOptions(config=config, calibrate=calibrate,
                                                      exporter="torchscript", check=False, optimized=False,
                                                      chunk_vectors=calibrate or every is not None), quiet=True)


def chunk_export(tmp_path_factory, arch: str = "bert", pooling: str | None = "mean", calibrate: bool = True,
                 every: int | str | None = None) -> tuple[Path, Path]:
    """(the export directory, the source model directory) of one tiny export."""
    name = f"chunks-{arch}-{pooling}-{'cal' if calibrate else 'plain'}-{every or 'none'}"
    root = built_once(tmp_path_factory, name, lambda p: _build(p, arch, pooling, calibrate, every))
    return root / "export", root / "model"
