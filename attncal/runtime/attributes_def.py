"""The native definition of the ai.attncal attributes (plugins/kernels/common/attncal_attributes.def),
read from Python: the table itself, and the ctypes mirror of the C struct generated from it
(AttncalParams, plugins/kernels/common/attncal_params.h), for callers of the CUDA launchers through
ctypes (benchmarks/gpu_check.py).

Why it reads the .def instead of restating it: the struct's layout follows the table (all_rows,
then every INT attribute, then every FLOAT attribute, in the table's order), so a mirror written out
by hand goes wrong silently the day the table changes; one built from the table cannot.
tests/test_attributes_def.py checks the table against attncal.graphs.ops.contract.ATTRIBUTES.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Mapping

from ..graphs.ops import contract
from ..native import CHECKOUT

DEF_PATH = CHECKOUT / "plugins" / "kernels" / "common" / "attncal_attributes.def"
TYPES = ("INT", "FLOAT")
OPS = ("ALL", "POOLED", "ATTENTION")
PRESENCE = ("REQUIRED", "OPTIONAL")

_ROW = re.compile(r"^ATTNCAL_ATTR\(\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*,\s*(\w+)\s*,\s*([^)]*?)\s*\)")


@dataclass(frozen=True)
class Attribute:
    """One row of the table: ATTNCAL_ATTR(name, type, ops, presence, default)."""

    name: str
    type: str  # "INT" or "FLOAT"
    ops: str  # "ALL", "POOLED" (the pooled-row ops) or "ATTENTION" (the calibrated attention ops)
    required: bool
    default: int | float  # what an OPTIONAL attribute a node lacks takes

    def taken_by(self, op_type: str) -> bool:
        """Whether op `op_type` (any of attncal.graphs.ops.contract.ALL_OP_TYPES) takes this attribute."""
        if self.ops == "POOLED":
            return not contract.is_all_rows(op_type)
        if self.ops == "ATTENTION":
            return contract.is_attention(op_type)
        contract.calibration_of(op_type)  # refuses an unknown op
        return True


def parse(text: str) -> list[Attribute]:
    """The rows of a .def text, in order; a malformed row (a line starting ATTNCAL_ATTR that the one
    pattern does not read, or an unknown type, ops or presence) raises ValueError naming it."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.startswith("ATTNCAL_ATTR"):
            continue
        m = _ROW.match(line)
        if m is None:
            raise ValueError(f"attncal_attributes.def:{number}: not a row: {line!r}")
        name, type_, ops, presence, default = m.groups()
        if type_ not in TYPES or ops not in OPS or presence not in PRESENCE:
            raise ValueError(f"attncal_attributes.def:{number}: type {type_!r} (of {TYPES}), ops {ops!r} (of {OPS}), "
                             f"presence {presence!r} (of {PRESENCE})")
        value = float(default) if type_ == "FLOAT" else int(default)
        rows.append(Attribute(name, type_, ops, presence == "REQUIRED", value))
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"attncal_attributes.def: a name appears twice: {names}")
    return rows


@lru_cache(maxsize=None)
def attributes(path: Path = DEF_PATH) -> tuple[Attribute, ...]:
    """The table read from `path` (default: this checkout's plugins/kernels/common/attncal_attributes.def)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: the attribute table is read from a source checkout (plugins/ is not "
                                "part of the installed package)")
    return tuple(parse(Path(path).read_text()))


def params_fields(rows: tuple[Attribute, ...] | list[Attribute]) -> list[tuple[str, type]]:
    """AttncalParams' members as ctypes fields: all_rows, then the INT attributes, then the FLOAT ones."""
    return ([("all_rows", ctypes.c_int32)] + [(r.name, ctypes.c_int32) for r in rows if r.type == "INT"]
            + [(r.name, ctypes.c_float) for r in rows if r.type == "FLOAT"])


@lru_cache(maxsize=None)
def params_structure(path: Path = DEF_PATH) -> type[ctypes.Structure]:
    """The ctypes mirror of AttncalParams, built from the table at `path`."""
    return type("AttncalParams", (ctypes.Structure,), {
        "__doc__": "Mirror of AttncalParams (plugins/kernels/common/attncal_params.h), built from "
                   "attncal_attributes.def.",
        "_fields_": params_fields(attributes(path)),
    })


def make_params(all_rows: bool, attrs: Mapping[str, int | float], path: Path = DEF_PATH) -> ctypes.Structure:
    """An AttncalParams for an op with these attribute values (names the table lacks raise KeyError;
    attributes not given keep 0, as the native parser leaves the ones an op does not take)."""
    cls = params_structure(path)
    known = {name for name, _ in cls._fields_}
    unknown = set(attrs) - known
    if unknown:
        raise KeyError(f"not attributes of the table: {sorted(unknown)}")
    return cls(all_rows=int(all_rows), **{k: v for k, v in attrs.items()})
