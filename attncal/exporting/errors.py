"""The export's own failures; a problem with the user's input is refused earlier, by the plan (`attncal.exporting.plan`),
as a ValueError or FileExistsError."""

from __future__ import annotations


class ExportError(RuntimeError):
    """The export itself failed (not a user input problem)."""


class ParityError(RuntimeError):
    """The exported model does not match the PyTorch reference."""
