"""attncal.cpuinfo: the CPU feature class from /proc/cpuinfo flags, and which classes an int8 graph's figures
cover for its weight range."""

from __future__ import annotations

import json

import pytest

from attncal import cpuinfo

_VNNI = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni"
_SKYLAKE_X = "fpu sse2 avx avx2 fma avx512f avx512bw avx512vl"
_ALDER_LAKE = "fpu sse2 avx avx2 fma avx_vnni"
_HASWELL = "fpu sse2 avx avx2 fma"


@pytest.mark.parametrize("machine, flags, expected", [
    ("x86_64", _VNNI, cpuinfo.AVX512_VNNI),
    ("x86_64", _SKYLAKE_X, cpuinfo.AVX512),
    ("x86_64", _ALDER_LAKE, cpuinfo.AVX_VNNI),
    ("x86_64", _HASWELL, cpuinfo.AVX2),
    ("AMD64", _HASWELL, cpuinfo.AVX2),  # Windows' name
    ("x86_64", "fpu sse2 sse4_2 avx", cpuinfo.OTHER),
    ("x86_64", "", cpuinfo.OTHER),  # no flags readable
    ("aarch64", "fp asimd asimddp", cpuinfo.AARCH64),
    ("arm64", "", cpuinfo.AARCH64),  # macOS' name
    ("ppc64le", _VNNI, cpuinfo.OTHER),
])
def test_class_from_flags(machine, flags, expected):
    assert cpuinfo.class_from_flags(machine, flags.split()) == expected


def test_cpu_flags_reads_the_first_processor(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(f"processor\t: 0\nmodel name\t: X\nflags\t\t: {_VNNI}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpuinfo.cpu_flags(f) == set(_VNNI.split())
    assert cpuinfo.cpu_flags(tmp_path / "missing") == set()
    assert cpuinfo.cpu_class() in cpuinfo.CLASSES


def test_coverage_follows_the_weight_format():
    pair_sum_too = [cpuinfo.AVX512_VNNI, cpuinfo.AVX_VNNI, cpuinfo.AVX512, cpuinfo.AVX2]
    # uint8 weights (U8U8 kernels: int16 operands, int32 sums) and 7-bit int8 weights (2 * 255 * 64 = 32640
    # fits int16) are added exactly by every kernel of these classes.
    u8 = cpuinfo.int8_coverage(cpuinfo.AVX512_VNNI, "uint8", (0, 255))
    assert u8["covers"] == pair_sum_too and "vpmaddwd" in u8["why"]
    seven = cpuinfo.int8_coverage(cpuinfo.AVX2, "int8", (-64, 64))
    assert seven["covers"] == pair_sum_too and "32640" in seven["why"]
    # 8-bit int8 weights: only the VNNI classes sum exactly; a graph checked on AVX2 covers AVX2 alone.
    eight = cpuinfo.int8_coverage(cpuinfo.AVX512_VNNI, "int8", (-127, 127))
    assert eight["covers"] == [cpuinfo.AVX512_VNNI, cpuinfo.AVX_VNNI] and "saturate" in eight["why"]
    assert cpuinfo.int8_coverage(cpuinfo.AVX2, "int8", (-127, 127))["covers"] == [cpuinfo.AVX2]
    assert cpuinfo.int8_coverage(cpuinfo.AARCH64, "uint8", (0, 255))["covers"] == [cpuinfo.AARCH64]
    assert cpuinfo.exact_classes("int8", 65) == cpuinfo.VNNI_CLASSES  # 2 * 255 * 65 = 33150 > 32767


def test_uncovered_names_both_classes_in_one_line():
    record = cpuinfo.int8_coverage(cpuinfo.AVX512_VNNI, "int8", (-127, 127))
    assert cpuinfo.uncovered(record, cpuinfo.AVX_VNNI) is None
    message = cpuinfo.uncovered(record, cpuinfo.AVX2)
    assert "avx512-vnni" in message and "this CPU is avx2" in message and "\n" not in message
    assert "records no CPU class" in cpuinfo.uncovered(None, cpuinfo.AVX2)
    assert "this CPU: avx2: WARNING" in cpuinfo.coverage_line(record, cpuinfo.AVX2)
    assert cpuinfo.coverage_line(record, cpuinfo.AVX512_VNNI).endswith("(covered)")


def test_figures_measured_here_cover_what_the_graph_weights_allow():
    eight = {"weights": "int8", "weight_range": [-127, 127]}
    assert cpuinfo.figures_cover(eight, cpuinfo.AVX2)["covers"] == [cpuinfo.AVX2]
    assert cpuinfo.figures_cover(eight, cpuinfo.AVX512_VNNI)["covers"] == list(cpuinfo.VNNI_CLASSES)
    u8 = cpuinfo.figures_cover({"weights": "uint8", "weight_range": [0, 255]}, cpuinfo.AVX2)
    assert u8["cpu_class"] == cpuinfo.AVX2 and cpuinfo.AVX512_VNNI in u8["covers"]
    assert cpuinfo.figures_cover(None, cpuinfo.AVX2)["covers"] == [cpuinfo.AVX2]


def test_int8_record_reads_the_graph_metadata():
    record = cpuinfo.int8_coverage(cpuinfo.AVX2, "uint8", (0, 255))
    assert cpuinfo.int8_record({cpuinfo.INT8_RECORD_KEY: json.dumps(record)}) == record
    assert cpuinfo.int8_record({}) is None
    assert cpuinfo.int8_record({cpuinfo.INT8_RECORD_KEY: "not json"}) is None
    assert cpuinfo.int8_record({cpuinfo.INT8_RECORD_KEY: json.dumps({"covers": "avx2"})}) is None
