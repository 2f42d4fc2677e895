"""This machine's CPU feature class, and on which classes an int8 graph computes what it computed when checked.

ONNX Runtime runs a dynamically quantized MatMul as uint8 activations times int8 (U8S8) or uint8 (U8U8)
weights, in the kernel its MLAS library picks for the CPU at start-up.  The kernels differ in how they add the
products:

* U8S8 on VNNI (`avx512-vnni`, `avx-vnni`): vpdpbusd adds four u8 x s8 products into int32, exactly.
* U8S8 on AVX-512 without VNNI (`avx512`) and AVX2 (`avx2`): vpmaddubsw adds two u8 x s8 products into int16
  with saturation, so with 8-bit weights (|q| up to 127) two products of 255 * 127 overflow and the sum is
  clipped.  With 7-bit weights (|q| <= 64, reduce_range) two products stay within 2 * 255 * 64 = 32640 <= 32767.
* U8U8 on all four: both operands widened to int16, products added in int32 (vpmaddwd), exactly; no VNNI.
* `aarch64` and `other` (x86-64 without AVX2, or a CPU whose flags cannot be read): other kernels, whose
  arithmetic this module makes no claim about.

So an int8 graph whose integer sums are exact where it was checked computes the same integers on every class
whose kernels are exact for its weight format; the fp32 parts around them differ by rounding, which can move
an activation by one quantization step, so the embeddings agree closely rather than bit for bit.  `int8_coverage` states that claim for a graph; `uncovered` says when this CPU is
outside it.  The class comes from Linux's /proc/cpuinfo flags (what the kernel reports the CPU and OS support)
and `platform.machine()`; under user-mode emulation /proc shows the host's flags, not the emulated CPU's.
"""

from __future__ import annotations

import functools
import json
import platform
import warnings
from pathlib import Path
from typing import Iterable, Mapping, Sequence

AVX512_VNNI = "avx512-vnni"
AVX_VNNI = "avx-vnni"
AVX512 = "avx512"
AVX2 = "avx2"
AARCH64 = "aarch64"
OTHER = "other"
CLASSES = (AVX512_VNNI, AVX_VNNI, AVX512, AVX2, AARCH64, OTHER)

VNNI_CLASSES = (AVX512_VNNI, AVX_VNNI)  # u8 x s8 products added in int32: exact for any int8 weight
PAIR_SUM_CLASSES = (AVX512, AVX2)  # two u8 x s8 products added in saturating int16 (vpmaddubsw)
_UINT8_MAX = 255
_INT16_MAX = 32767
_CPUINFO = Path("/proc/cpuinfo")

# The key of the record an int8 graph carries in its ONNX metadata (`quantization_record` of
# attncal.exporting.quantize, JSON): its weight range and the classes its figures cover.
INT8_RECORD_KEY = "attncal.int8"


class Int8CpuWarning(UserWarning):
    """An int8 graph runs on a CPU class its parity figures do not cover."""


def class_from_flags(machine: str, flags: Iterable[str]) -> str:
    """The feature class of a CPU of architecture `machine` (`platform.machine()`) with these /proc/cpuinfo
    flags, as ONNX Runtime's U8S8 kernel choice sees it (VNNI over AVX-512 over AVX-VNNI over AVX2)."""
    if machine.lower() in ("aarch64", "arm64"):
        return AARCH64
    if machine.lower() not in ("x86_64", "amd64"):
        return OTHER
    f = set(flags)
    if {"avx512bw", "avx512_vnni"} <= f:
        return AVX512_VNNI
    if "avx512bw" in f:
        return AVX512
    if {"avx2", "avx_vnni"} <= f:
        return AVX_VNNI
    if "avx2" in f:
        return AVX2
    return OTHER


def cpu_flags(path: Path = _CPUINFO) -> set[str]:
    """The first processor's `flags` in /proc/cpuinfo (empty where there is none: not Linux, or not x86)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return set(value.split())
    return set()


@functools.cache
def cpu_class() -> str:
    """This machine's class: one of CLASSES."""
    return class_from_flags(platform.machine(), cpu_flags())


def exact_classes(weights: str, weight_max: int) -> tuple[str, ...]:
    """The classes whose ONNX Runtime kernels add every product exactly for activations in [0, 255] and weights
    of type `weights` ("int8" or "uint8") up to |weight_max|."""
    if weights == "uint8" or 2 * _UINT8_MAX * weight_max <= _INT16_MAX:
        return VNNI_CLASSES + PAIR_SUM_CLASSES
    return VNNI_CLASSES


def int8_coverage(checked_on: str, weights: str, weight_range: Sequence[int]) -> dict:
    """The claim for int8 figures measured on class `checked_on` of a graph whose weights of type `weights`
    ("int8" or "uint8") lie in `weight_range` [qmin, qmax]: the classes they cover and why."""
    weight_max = max(abs(int(q)) for q in weight_range)
    exact = exact_classes(weights, weight_max)
    if checked_on not in exact:
        return {"cpu_class": checked_on, "covers": [checked_on],
                "why": f"{checked_on} only: its integer sums are not known to equal another class's"}
    if weights == "uint8":
        how = ("uint8 weights: the U8U8 kernels of every AVX2 class widen both operands to int16 and add their "
               "products in int32 (vpmaddwd), exactly")
    elif AVX2 in exact:
        how = (f"int8 weights up to {weight_max}: the VNNI kernels add u8 x s8 products in int32; two products stay "
               f"within 2 * {_UINT8_MAX} * {weight_max} = {2 * _UINT8_MAX * weight_max} <= {_INT16_MAX}, so the "
               f"int16 pair sums of {' and '.join(PAIR_SUM_CLASSES)} are exact too")
    else:
        how = (f"int8 weights up to {weight_max}: the VNNI kernels add u8 x s8 products in int32, exactly; the int16 "
               f"pair sums of {' and '.join(PAIR_SUM_CLASSES)} saturate above {_INT16_MAX}, which "
               f"2 * {_UINT8_MAX} * {weight_max} exceeds")
    return {"cpu_class": checked_on, "covers": list(exact),
            "why": f"{how}; the covered classes compute the same integer products, the fp32 parts differ by rounding "
                   "(which can move an activation by one quantization step)"}


def figures_cover(record: dict | None, here: str | None = None) -> dict:
    """`int8_coverage` of figures measured on this CPU (class `here`, default `cpu_class()`) for a graph with
    this record (`int8_record`); this class alone where the graph records no weight format."""
    here = here or cpu_class()
    if record is None or "weights" not in record or "weight_range" not in record:
        return {"cpu_class": here, "covers": [here], "why": f"{here} only: the graph records no weight format"}
    return int8_coverage(here, record["weights"], record["weight_range"])


def int8_record(props: Mapping[str, str]) -> dict | None:
    """The int8 record in a graph's ONNX metadata (`InferenceSession.get_modelmeta().custom_metadata_map`, or
    the proto's metadata_props as a dict); None where it has none (a graph made before it was recorded)."""
    text = props.get(INT8_RECORD_KEY)
    if text is None:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("covers"), list) else None


def uncovered(record: dict | None, here: str | None = None) -> str | None:
    """One line saying that this CPU (class `here`, default `cpu_class()`) is not a class the int8 graph's
    figures cover, or None where it is."""
    here = here or cpu_class()
    if record is None:
        return (f"this int8 graph records no CPU class for its parity figures (made before attncal recorded "
                f"one); this CPU is {here}: check it here with `attncal check`, or re-export")
    if here in record["covers"]:
        return None
    return (f"this int8 graph's parity figures were measured on {record.get('cpu_class')} and cover "
            f"{', '.join(record['covers'])}; this CPU is {here}, whose int8 sums may differ: check it here "
            "with `attncal check`")


def coverage_line(record: dict | None, here: str | None = None) -> str:
    """One line on an int8 graph's record and this CPU (class `here`, default `cpu_class()`): `attncal inspect`."""
    here = here or cpu_class()
    message = uncovered(record, here)
    if record is None:
        return message
    weights = record.get("weight_range")
    return (f"figures measured on {record.get('cpu_class')}, cover {', '.join(record['covers'])} (weights in "
            f"{weights}); this CPU: {here}" + (f": WARNING {message}" if message else " (covered)"))


def warn_if_uncovered(record: dict | None, graph: str) -> None:
    """`uncovered` as an Int8CpuWarning naming the graph."""
    message = uncovered(record)
    if message is not None:
        warnings.warn(f"{graph}: {message}", Int8CpuWarning, stacklevel=3)
