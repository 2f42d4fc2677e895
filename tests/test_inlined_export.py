"""`attncal export --inlined`: the portable graph with its `ai.attncal` functions inlined into standard ONNX
(onnx/model_inlined.onnx), checked like every graph, and run by OpenVINO at parity."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest

from attncal.artifact import INLINED_GRAPH, PORTABLE_GRAPH, stamp_onnx
from attncal.calibration.config import CalibrationConfig
from attncal.calibration.encode import TorchEncoder
from attncal.cli import main
from attncal.exporting.exporter import export
from attncal.exporting.inline import STANDARD_DOMAINS
from attncal.exporting.plan import ExportOptions
from attncal.runtime.encoder import Encoder
from attncal.runtime.parity import check_parity
from attncal.synthetic import save_synthetic_model

from conftest import quick_exporter

TEXTS = ["calibration", "a passage about attention calibration and retrieval " * 12]
HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
CALIBRATION = CalibrationConfig(basket_size=4, strength=1.0, layers="all")


@pytest.fixture(scope="module")
def inlined_exports(tmp_path_factory, shared_raw_exports):
    """A tiny mean-pooled BERT (softmax-row calibration: the function body whose attributes feed Constant nodes,
    which `onnx.inliner` leaves unbound) exported calibrated and uncalibrated, both with --inlined.  Strength 1
    in every layer with small baskets, so that the calibration moves this random model's embeddings (by about
    2.6e-3 on TEXTS) well beyond the parity tolerance."""
    root = tmp_path_factory.mktemp("inlined")
    model = save_synthetic_model("bert", root / "model", seed=1, max_positions=256, pooling="mean")
    metas = {}
    for name, cal in (("cal", True), ("uncal", False)):
        metas[name] = export(model, root / name, ExportOptions(
            config=CALIBRATION, calibrate=cal, inlined=True, optimized=False,
            exporter=quick_exporter("bert")), quiet=True)
    return root, model, metas


def test_inlined_graph_is_standard_onnx_at_parity_in_attncal_json_and_check(inlined_exports, capsys):
    root, _, metas = inlined_exports
    entry = metas["cal"]["graphs"][INLINED_GRAPH]
    assert entry["inlined"] == metas["cal"]["num_layers"]  # one call per calibrated layer
    assert entry["placement"] == metas["cal"]["graphs"][PORTABLE_GRAPH]["placement"]
    assert entry["parity"]["ok"] and entry["parity"]["max_abs"] <= 1e-5
    model = onnx.load(str(root / "cal" / INLINED_GRAPH))
    portable = onnx.load(str(root / "cal" / PORTABLE_GRAPH))
    assert len(portable.functions) == 1 and not model.functions
    assert {n.domain for n in model.graph.node} <= set(STANDARD_DOMAINS)
    assert {o.domain for o in model.opset_import} <= set(STANDARD_DOMAINS)
    assert not any(a.ref_attr_name for n in model.graph.node for a in n.attribute)
    onnx.checker.check_model(model, full_check=True)
    # The same weights as the portable graph: the inlining changes nodes only.
    assert {t.name: t.raw_data for t in model.graph.initializer if t.dims} == \
           {t.name: t.raw_data for t in portable.graph.initializer if t.dims}
    # `attncal check` checks it with the others (and alone), and the runtime runs it without the native library.
    assert main(["check", str(root / "cal")]) == 0
    assert f"{INLINED_GRAPH}:" in capsys.readouterr().out
    assert main(["check", str(root / "cal"), "--graph", "inlined"]) == 0
    enc = Encoder(root / "cal", graph="inlined")
    assert enc.graph_file == INLINED_GRAPH and enc.custom_op_library is None
    assert np.abs(enc.encode(TEXTS) - Encoder(root / "cal", graph="portable", native=False).encode(TEXTS)).max() <= 1e-6


def test_uncalibrated_export_writes_no_inlined_graph(inlined_exports):
    """The uncalibrated portable graph calls no function: it is standard ONNX already."""
    root, _, metas = inlined_exports
    assert INLINED_GRAPH not in metas["uncal"]["graphs"] and not (root / "uncal" / INLINED_GRAPH).exists()
    assert not onnx.load(str(root / "uncal" / PORTABLE_GRAPH)).functions
    with pytest.raises(FileNotFoundError, match="--inlined"):
        Encoder(root / "uncal", graph="inlined")


def test_onnx_inliner_alone_leaves_attribute_references_that_onnxruntime_refuses(inlined_exports):
    """Why attncal binds the attributes itself: `onnx.inliner.inline_local_functions` drops the body's attribute
    references instead of binding them, leaving Constant nodes with no value."""
    root, _, _ = inlined_exports
    plain = onnx.inliner.inline_local_functions(onnx.load(str(root / "cal" / PORTABLE_GRAPH)))
    assert any(n.op_type == "Constant" and not n.attribute for n in plain.graph.node)
    with pytest.raises(Exception, match="Constant node:.* has no data attributes"):
        ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"])


def test_parity_check_fails_on_a_wrongly_bound_attribute(inlined_exports, tmp_path):
    """Planted bug: the calibration strength each call site bound into the inlined body halved, the graph's
    digest stamped again so that it loads; the parity check of the inlined graph must fail."""
    import shutil

    root, _, metas = inlined_exports
    broken = tmp_path / "broken"
    shutil.copytree(root / "cal", broken)
    path = broken / INLINED_GRAPH
    model = onnx.load(str(path))
    strengths = [a for n in model.graph.node if n.op_type == "Constant" and "_attr_strength" in n.output[0]
                 for a in n.attribute if a.name == "value_float"]
    assert len(strengths) == len(metas["cal"]["calibrated_layers"])  # one per calibrated layer
    for a in strengths:
        a.f = 0.5
    onnx.save(model, str(path))
    stamp_onnx(path)
    report = check_parity(broken, graph="inlined")
    assert not report.ok and report.max_abs > 10 * report.tol_max_abs


@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino not installed (pip install 'attncal[openvino]')")
def test_openvino_runs_the_inlined_graph_at_parity_and_refuses_the_portable_one(inlined_exports):
    import openvino as ov

    root, model, metas = inlined_exports
    core = ov.Core()
    config = CalibrationConfig.from_dict(metas["cal"]["config"])
    ref = TorchEncoder(model)
    for name, graph, cfg in (("cal", INLINED_GRAPH, config), ("uncal", PORTABLE_GRAPH, None)):
        enc = Encoder(root / name, graph="portable")
        feeds = enc.tokenize(TEXTS)
        # float32 inference: OpenVINO computes in bfloat16 by default on CPUs that have it (AVX-512 BF16, AMX).
        compiled = core.compile_model(core.read_model(str(root / name / graph)), "CPU",
                                      {"INFERENCE_PRECISION_HINT": "f32"})
        got = compiled(feeds)[compiled.output("sentence_embedding")]
        import torch

        batch = {k: torch.from_numpy(v) for k, v in feeds.items()}
        expected = ref.forward(batch, cfg).numpy()
        assert np.abs(got - expected).max() <= 1e-5, (name, np.abs(got - expected).max())
        if cfg is not None:  # the check tells the calibrated graph from the uncalibrated one
            assert np.abs(got - ref.forward(batch, None).numpy()).max() > 1e-4
    with pytest.raises(Exception, match="SoftmaxAllRowsCalibration"):
        core.read_model(str(root / "cal" / PORTABLE_GRAPH))


def test_inlined_option_is_on_the_command_line_and_in_the_disk_estimate(tiny_models):
    from attncal.cli import build_parser
    from attncal.exporting import memory_plan

    args = build_parser().parse_args(["export", str(tiny_models["bert"]), "-o", "x", "--inlined"])
    assert args.inlined is True
    kw = dict(exporter="torchscript", optimized=False, check=False)
    plain, inlined = (memory_plan.estimate(tiny_models["bert"], **kw, inlined=flag) for flag in (False, True))
    assert inlined.disk - plain.disk == pytest.approx(plain.weights, abs=1)
    json.dumps(inlined.options, default=str)
