"""What an export's steps pass on (`Run`), and how they say what they do."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..memory import StepMeter
from .plan import ExportPlan, stage_label


@dataclass
class Run:
    """The plan, the working directory, and what each step produced."""

    plan: ExportPlan
    tmp: Path
    quiet: bool
    meter: StepMeter
    log_start: int  # where this export's lines begin in the console's capture (a command may export twice)
    features: frozenset[str] = frozenset()  # what the attention holds (attncal.calibration.probing)
    input_names: list[str] = field(default_factory=list)
    raw_path: Path | None = None  # torch's export, weights on disk
    result: object | None = None  # the portable graph's PlacementResult
    graphs: dict = field(default_factory=dict)  # graph file -> its attncal.json entry
    optimizer_note: str | None = None
    quantization: dict | None = None
    ts_root: Path | None = None  # the folder of the TorchScript export ORT's optimizer runs on, removed after it
    cache: dict = field(default_factory=dict)  # a source graph -> (its ORT-optimized copy on disk, messages)

    def log(self, msg: str) -> None:
        """A line of attncal's own on stderr (unless quiet); under a command, its log records it for context."""
        if not self.quiet:
            print(f"attncal: {msg}", file=sys.stderr, flush=True)

    def progress(self, stage: str, msg: str) -> None:
        """A step line numbered by its stage of the plan ("[2/4] ...")."""
        self.log(f"{stage_label(stage)} {msg}")
