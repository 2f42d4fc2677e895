"""The one native definition of the ai.attncal attributes (plugins/kernels/common/attncal_attributes.def) and
the parser generated from it:

* the table agrees with attncal.graphs.ops.contract (names in order, types, which ops take each, only
  `layer` optional), and no other native file under plugins/ spells an attribute's name as a string;
* the ctypes mirror of AttncalParams (attncal.runtime.attributes_def, used through tests/support/cuda.py by
  the GPU tests and benchmarks/gpu_check.py) is built from the table and has the C struct's layout (a
  small C++ program compiled with g++ prints the offsets);
* ONNX Runtime, through the custom-op library, refuses malformed nodes with a message naming the
  field: `strength` missing with a stray `pool_last` in its place (the case a count of the fields
  seen accepted), ill-typed, foreign fields; a duplicated attribute is refused by ONNX Runtime's own
  loader before any kernel sees the node.

The TensorRT side of the same refusals runs in the host tests (tests/test_native_trt.py)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from attncal.calibration.config import CalibrationConfig
from attncal.graphs.ops import contract
from attncal.graphs.ops.contract import DOMAIN, VERSION, attention_op_spec, op_spec
from attncal.pooling import Pooling
from attncal.runtime import attributes_def, oplib

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "plugins" / "kernels"


def test_def_matches_the_contract():
    rows = attributes_def.attributes()
    assert [r.name for r in rows] == list(contract.ATTRIBUTES)
    for r in rows:
        assert r.type.lower() == contract.ATTRIBUTES[r.name][0], r.name
    for op in contract.ALL_OP_TYPES:
        assert [r.name for r in rows if r.taken_by(op)] == contract.attribute_names(op), op
    optional = [r for r in rows if not r.required]
    assert [r.name for r in optional] == ["layer", *contract.OPTIONAL_DEFAULTS]
    assert contract.ATTRIBUTES["layer"][1] == "informational"
    # The optional attributes' defaults (marked rows, geometry) are the table's.
    assert {r.name: r.default for r in optional[1:]} == contract.OPTIONAL_DEFAULTS
    # Every exported node carries exactly the attributes the table gives its op, the optional ones where they
    # differ from the defaults.
    geo = contract.AttentionGeometry(num_kv_heads=2, window_left=3, window_right=0, relative_max_distance=128)
    landmark = CalibrationConfig(pooling=Pooling("lmk", token_id=2), variant="cls-hard").resolve()
    marks = {"marked_rows": 1, "isolate_self": 1, "self_mode": 2, "self_weight": 0.3}
    for rc, marked in ((CalibrationConfig(pooling="cls").resolve(), {}),
                       (CalibrationConfig(pooling="mean").resolve(), {}), (landmark, marks)):
        for spec, written in ((op_spec(rc, 3), marked), (op_spec(rc, 3, fused_softmax=True), marked),
                              (attention_op_spec(rc, 3, 4), marked),
                              (attention_op_spec(rc, 3, 4, projected=True), marked),
                              (attention_op_spec(rc, 3, 4, geometry=geo), {**marked, **geo.attrs()})):
            taken = [r.name for r in rows if r.taken_by(spec.op_type)]
            assert list(spec.attrs) == [n for n in taken if n not in contract.OPTIONAL_DEFAULTS or n in written]
            assert {k: v for k, v in spec.attrs.items() if k in contract.OPTIONAL_DEFAULTS} == pytest.approx(written)
            for r in rows:
                if r.name in spec.attrs:
                    assert isinstance(spec.attrs[r.name], float if r.type == "FLOAT" else int), (spec.op_type, r.name)


def test_def_reader_refuses_malformed_rows():
    with pytest.raises(ValueError, match="not a row"):
        attributes_def.parse("ATTNCAL_ATTR(strength, FLOAT, ALL)\n")
    with pytest.raises(ValueError, match="'DOUBLE'"):
        attributes_def.parse("ATTNCAL_ATTR(strength, DOUBLE, ALL, REQUIRED, 0)\n")
    with pytest.raises(ValueError, match="twice"):
        attributes_def.parse("ATTNCAL_ATTR(a, INT, ALL, REQUIRED, 0)\nATTNCAL_ATTR(a, INT, ALL, REQUIRED, 0)\n")


def test_attribute_names_are_spelled_in_one_native_file():
    names = "|".join(contract.ATTRIBUTES)
    literal = re.compile(rf'"({names})\b')
    hits = []
    for path in sorted((ROOT / "plugins").rglob("*")):
        if path.suffix in {".h", ".cc", ".cpp", ".cu", ".cuh", ".def", ".txt", ".cmake"} and path.is_file():
            hits += [f"{path.relative_to(ROOT)}:{m.group(0)}" for m in literal.finditer(path.read_text())]
    assert hits == []
    assert all(re.search(rf"^ATTNCAL_ATTR\({n},", (KERNELS / "common" / "attncal_attributes.def").read_text(), re.M)
               for n in contract.ATTRIBUTES)


def test_ctypes_mirror_is_built_from_the_def():
    from support import cuda

    assert cuda.Params is attributes_def.params_structure()
    rows = attributes_def.attributes()
    expected = (["all_rows"] + [r.name for r in rows if r.type == "INT"] + [r.name for r in rows if r.type == "FLOAT"])
    assert [n for n, _ in cuda.Params._fields_] == expected
    rc = CalibrationConfig(pooling="cls", strength=0.25).resolve()
    p = cuda.params_of(rc)
    assert (p.all_rows, p.strength, p.basket_size, p.pool_last) == (0, 0.25, rc.basket_size, int(rc.pool_last))
    with pytest.raises(KeyError, match="strenght"):
        attributes_def.make_params(False, {"strenght": 0.5})


def test_ctypes_mirror_has_the_c_layout(tmp_path):
    """The C struct's size and every member's offset and size, printed by a program the X-macro
    generates, against the ctypes mirror's."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler (g++)")
    src = tmp_path / "layout.cpp"
    src.write_text("""
#include <cstddef>
#include <cstdio>
#include "common/attncal_params.h"
int main() {
  std::printf("all_rows %zu %zu\\n", offsetof(AttncalParams, all_rows), sizeof(AttncalParams::all_rows));
#define ATTNCAL_ATTR(name, type, ops, presence, dflt) \\
  std::printf(#name " %zu %zu\\n", offsetof(AttncalParams, name), sizeof(AttncalParams::name));
#include "common/attncal_attributes.def"
#undef ATTNCAL_ATTR
  std::printf("sizeof %zu 0\\n", sizeof(AttncalParams));
}
""")
    exe = tmp_path / "layout"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-I", str(KERNELS), str(src), "-o", str(exe)], check=True,
                   capture_output=True, text=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    c_layout = {name: (int(off), int(size)) for name, off, size in (line.split() for line in out.splitlines())}
    cls = attributes_def.params_structure()
    py_layout = {name: (getattr(cls, name).offset, getattr(cls, name).size) for name, _ in cls._fields_}
    assert c_layout.pop("sizeof")[0] == ctypes.sizeof(cls)
    assert c_layout == py_layout


# ------------------------------------------------------------------ ONNX Runtime refusals


@pytest.fixture(scope="module")
def library() -> Path:
    try:
        return oplib.build_library()
    except oplib.BuildError as exc:
        pytest.fail(str(exc))


VALID = op_spec(CalibrationConfig(pooling="cls").resolve(), 2).attrs


def _model(op: str, attrs: list[onnx.AttributeProto]) -> onnx.ModelProto:
    """One ai.attncal node over probs [1,1,3,3] (or, for an attention op, q/k/v [1,3,4]) and the mask."""
    if contract.is_attention(op):
        inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 3, 4]) for n in ("query", "key", "value")]
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, 4])
        names = ["query", "key", "value", "mask"]
    else:
        inputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 1, 3, 3])]
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 1, 3, 3])
        names = ["probs", "mask"]
    inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT64, [1, 3]))
    node = helper.make_node(op, names, ["out"], domain=DOMAIN)
    node.attribute.extend(attrs)
    graph = helper.make_graph([node], "g", inputs, [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, VERSION)])


def _run(library: Path, op: str, attrs: list[onnx.AttributeProto]) -> str:
    """'' when a session with the library runs the node, else ONNX Runtime's error."""
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    so.log_severity_level = 4
    feeds = {"mask": np.ones((1, 3), np.int64)}
    if contract.is_attention(op):
        feeds |= {n: np.full((1, 3, 4), 0.5, np.float32) for n in ("query", "key", "value")}
    else:
        feeds["probs"] = np.full((1, 1, 3, 3), 1 / 3, np.float32)
    try:
        sess = ort.InferenceSession(_model(op, attrs).SerializeToString(), so, providers=["CPUExecutionProvider"])
        sess.run(None, feeds)
    except Exception as exc:  # noqa: BLE001 (ONNX Runtime raises its own exception types)
        return str(exc)
    return ""


def _attrs(op: str, drop: tuple[str, ...] = (), **extra) -> list[onnx.AttributeProto]:
    values = {k: v for k, v in VALID.items() if k not in drop and k in contract.attribute_names(op)}
    if contract.is_attention(op):
        values |= {k: v for k, v in {"num_heads": 2, "scale": 0.0}.items() if k not in drop}
    return [helper.make_attribute(k, v) for k, v in values.items()] + [helper.make_attribute(k, v)
                                                                        for k, v in extra.items()]


def test_ort_accepts_the_valid_nodes(library):
    for op in (contract.POOLED_OP, contract.ALL_ROWS_OP, contract.ATTENTION_POOLED_OP):
        assert _run(library, op, _attrs(op)) == "", op
        assert _run(library, op, _attrs(op, drop=("layer",))) == "", op  # layer is OPTIONAL


def test_ort_refuses_missing_strength_with_a_stray_field(library):
    """The count-based reading took this node: 10 fields, strength not among them."""
    err = _run(library, contract.ALL_ROWS_OP, _attrs(contract.ALL_ROWS_OP, drop=("strength",), pool_last=0))
    assert "missing attribute 'strength'" in err and "does not take: 'pool_last'" in err, err
    err = _run(library, contract.SOFTMAX_ALL_ROWS_OP,
               _attrs(contract.SOFTMAX_ALL_ROWS_OP, drop=("strength",), strenght=0.5))
    assert "missing attribute 'strength'" in err, err  # a name outside the table: not visible to a kernel
    err = _run(library, contract.ATTENTION_ALL_ROWS_OP,
               _attrs(contract.ATTENTION_ALL_ROWS_OP, drop=("strength",), pool_last=1))
    assert "missing attribute 'strength'" in err and "'pool_last'" in err, err


def test_ort_refuses_missing_strength_with_a_duplicated_field(library):
    """ONNX Runtime's loader refuses a repeated attribute name before the kernel is created, naming
    it; the kernel never sees such a node."""
    op = contract.POOLED_OP
    err = _run(library, op, _attrs(op, drop=("strength",), basket_size=4))
    assert "'basket_size' appeared multiple times" in err, err
    err = _run(library, op, _attrs(op, drop=("strength",), strength=0.5) + [helper.make_attribute("strength", 0.0)])
    assert "'strength' appeared multiple times" in err, err


def test_ort_refuses_ill_typed_and_foreign_attributes(library):
    op = contract.POOLED_OP
    err = _run(library, op, _attrs(op, drop=("strength",), strength=1))
    assert "'strength' must be a float, got an integer" in err, err
    err = _run(library, op, _attrs(op, drop=("strength",), strength="0.5"))
    assert "'strength' must be a float, got a string" in err, err
    err = _run(library, op, _attrs(op, drop=("basket_size",), basket_size=[4, 4]))
    assert "'basket_size' must be an integer, got a list" in err, err
    err = _run(library, op, _attrs(op, drop=("basket_size",), basket_size=4.0))
    assert "'basket_size' must be an integer, got a float" in err, err
    err = _run(library, op, _attrs(op, num_heads=2))
    assert "does not take: 'num_heads'" in err, err
    err = _run(library, contract.ATTENTION_POOLED_OP, _attrs(contract.ATTENTION_POOLED_OP, drop=("num_heads",)))
    assert "missing attribute 'num_heads'" in err, err
