"""The export format's one home (`attncal.artifact`): layout, attncal.json, digests, layering, public API.

`tiny_export` builds the session's one tiny export (a random-weight BERT, calibrated, portable graph
only) and caches it under pytest's base temp directory, so every module that imports it shares it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attncal import artifact
from attncal.artifact import ArtifactError, MissingArtifactError

ROOT = Path(__file__).resolve().parents[1]


def tiny_export(tmp_path_factory) -> Path:
    """The session's tiny export (built once; later calls reuse it). Treat it as read-only: copy it to damage it."""
    base = tmp_path_factory.getbasetemp() / "attncal-tiny-export"
    out = base / "export"
    if not (out / artifact.METADATA_FILE).exists():
        from attncal import CalibrationConfig, ExportOptions, export
        from attncal.synthetic import save_synthetic_model

        model = save_synthetic_model("bert", base / "model", seed=7, layers=2, max_positions=128, max_seq_length=64)
        export(str(model), out, ExportOptions(config=CalibrationConfig(basket_size=4, strength=1.0),
                                              exporter="torchscript", check=False, optimized=False), quiet=True)
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


def test_new_exports_are_format_3_with_files_and_digests(good):
    meta = artifact.read_metadata(good)
    assert meta["format"] == artifact.FORMAT_VERSION == 3
    assert {"config.json", "tokenizer.json"} <= set(meta["files"])
    model = artifact.load_onnx_checked(good / artifact.PORTABLE_GRAPH, require_digest=True)
    assert artifact.stored_digest(model) == artifact.graph_digest(model)
    assert artifact.open_export(good).graphs == [artifact.PORTABLE_GRAPH]


def test_format_1_is_still_read(good, tmp_path):
    """An export written before format 2 (no `files`, no digest in the graph) loads and encodes."""
    import onnx

    from attncal import Encoder

    old = tmp_path / "old"
    shutil.copytree(good, old)
    meta = json.loads((old / "attncal.json").read_text())
    meta["format"] = 1
    del meta["files"]
    (old / "attncal.json").write_text(json.dumps(meta))
    model = onnx.load(str(old / "onnx/model.onnx"))
    del model.metadata_props[:]
    onnx.save(model, str(old / "onnx/model.onnx"))
    a = Encoder(old).encode(["format one still works"])
    b = Encoder(good).encode(["format one still works"])
    assert np.array_equal(a, b)
    # ...but a format-2 export must carry its digest
    meta["format"] = 2
    meta["files"] = ["config.json"]
    (old / "attncal.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="has no attncal.digest"):
        Encoder(old)


def _format_2(meta: dict, pooling: str, spec: dict | None = None, **config) -> dict:
    """`meta` as format 2 wrote it: the pooling a word (with `pooling_spec` for landmark / mean-every), and so the
    calibration config's, with its `pool_token_id` and `pool_every`."""
    old = dict(meta, format=2, pooling=pooling, pooling_spec=spec)
    if old.get("config"):
        old["config"] = {**old["config"], "pooling": pooling, "pool_token_id": -1, "pool_every": 0, **config}
    return old


def test_format_2_pooling_is_still_read(good, tmp_path):
    """Format 2 spelled the pooling as a word plus `pooling_spec`; it reads as format 3's one `pooling` object, the
    calibration config's too, and the export encodes as before."""
    from attncal import Encoder

    meta = json.loads((good / "attncal.json").read_text())
    word = meta["pooling"]["kind"]
    assert meta["pooling"] == meta["config"]["pooling"] == {"kind": word} and word in ("cls", "mean", "last")
    old = tmp_path / "old"
    shutil.copytree(good, old)
    (old / "attncal.json").write_text(json.dumps(_format_2(meta, word)))
    read = artifact.read_metadata(old)
    assert read["pooling"] == meta["pooling"] and read["config"] == meta["config"] and "pooling_spec" not in read
    text = ["format two still works"]
    assert np.array_equal(Encoder(old).encode(text), Encoder(good).encode(text))
    # landmark: the spec says lmk or multi-cls (the config said `landmark` and the token id only)
    spec = {"style": "multi-cls", "every": "sentence", "token": "[CLS]", "token_id": 1}
    read = artifact.validate_metadata(_format_2(meta, "landmark", spec, pool_token_id=1))
    assert read["pooling"] == read["config"]["pooling"] == {"kind": "multi-cls", "every": "sentence",
                                                            "token": "[CLS]", "token_id": 1}
    read = artifact.validate_metadata(_format_2(meta, "mean-every", {"style": "mean-every", "every": 8},
                                                pool_every=8))
    assert read["pooling"] == read["config"]["pooling"] == {"kind": "mean-every", "every": 8}
    for damaged, message in ((_format_2(meta, "landmark"), "key 'pooling': invalid pooling: pooling 'landmark' "
                                                            "needs its pooling_spec"),
                             (_format_2(meta, "cls", spec), "key 'pooling': invalid pooling: pooling 'cls' takes no "
                                                            "pooling_spec")):
        with pytest.raises(ArtifactError, match=re.escape(message)):
            artifact.validate_metadata(damaged)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(format=4), "unknown export format version 4; this attncal reads formats 1, 2, 3; upgrade"),
    (lambda m: m.update(format="2"), "key 'format' must be an integer"),
    (lambda m: m.pop("format"), "missing key 'format'"),
    (lambda m: m.pop("pooling"), "missing key(s) 'pooling'"),
    (lambda m: m.update(calibrated="yes"), "key 'calibrated' must be true/false"),
    (lambda m: m.update(calibrated_layers=[1, "x"]), "list of integers"),
    (lambda m: m.update(config={"strength": 7}), "key 'config': "),
    (lambda m: m.update(inputs=["input_ids"]), "key 'inputs' must hold"),
    (lambda m: m.update(graphs={"../evil.onnx": {}}), "key 'graphs' names"),
    (lambda m: m.update(padding_side="middle"), "padding_side"),
])
def test_metadata_validation_names_the_problem(good, edit, message):
    meta = json.loads((good / "attncal.json").read_text())
    edit(meta)
    with pytest.raises(ArtifactError) as info:
        artifact.validate_metadata(meta, good / "attncal.json")
    assert str(info.value).startswith(f"{good / 'attncal.json'}: ") and message in str(info.value)


def test_write_metadata_is_atomic_and_validated(good, tmp_path):
    meta = artifact.read_metadata(good)
    artifact.write_metadata(tmp_path, dict(meta))
    assert artifact.read_metadata(tmp_path) == meta
    with pytest.raises(ArtifactError):
        artifact.write_metadata(tmp_path, dict(meta, calibrated="no"))
    assert artifact.read_metadata(tmp_path) == meta  # the old file is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attncal.json"]


def test_missing_files_are_file_not_found_and_artifact_errors(tmp_path):
    with pytest.raises(MissingArtifactError) as info:
        artifact.read_metadata(tmp_path)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    assert "not an attncal export" in str(info.value)


def test_digest_ignores_doc_strings_only(good, tmp_path):
    import onnx

    model = onnx.load(str(good / "onnx/model.onnx"))
    digest = artifact.graph_digest(model)
    model.doc_string = "rewritten by a tool"
    assert artifact.graph_digest(model) == digest
    model.graph.node[0].name += "x"
    assert artifact.graph_digest(model) != digest


def _fresh_python(code: str) -> str:
    """stdout of `code` run in a new interpreter from the checkout: what a module import pulls in shows only there."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_importing_artifact_loads_no_higher_layer():
    """What importing the export format pulls in at run time (tests/test_layers.py checks the imports as written)."""
    code = "import sys, attncal.artifact; print(sorted(m for m in sys.modules if m.startswith('attncal.')))"
    mods = _fresh_python(code)
    assert "attncal.exporting" not in mods and "attncal.runtime" not in mods


def test_public_api_short_and_deep_paths(good):
    code = ("import sys, attncal\n"
            "light = not any(m in sys.modules for m in ('torch', 'onnxruntime', 'attncal.runtime', 'attncal.corpus'))\n"
            "from attncal import export, Encoder, check, CalibrationConfig, ExportOptions, ArtifactError\n"
            "from attncal.exporting.exporter import export as deep_export\n"
            "from attncal.artifact import save_onnx, ONNX_FILE, METADATA_FILE\n"
            "from attncal.runtime import Encoder as DeepEncoder, check_parity\n"
            "import attncal.exporting.exporter as ex\n"
            "assert callable(export) and Encoder is DeepEncoder and check is check_parity and ex.export is deep_export\n"
            "assert save_onnx.__module__ == 'attncal.artifact.onnx_io' and ONNX_FILE == 'model.onnx'\n"
            "try:\n    from attncal import encode_corpus\nexcept ImportError:\n    encode_corpus = None\n"
            "print(light, encode_corpus is not None)\n")
    light, has_corpus = _fresh_python(code).split()
    assert light == "True"
    assert has_corpus == str((ROOT / "attncal/corpus/__init__.py").exists())


def test_inspect_and_the_runtime_modules_do_not_import_torch_or_the_rewrite_pass(good):
    """torch takes ~3 s to import here and onnx_ir (with sympy) ~1 s: the command line (`attncal inspect` run on
    an export), the Encoder's module and the calibration config must load without them (`attncal --help` took
    4.5 s, now 0.6), while every lazily loaded name still resolves to its module's object."""
    code = ("import sys, contextlib, io\n"
            "import attncal.cli, attncal.runtime.encoder, attncal.corpus.local\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n    assert attncal.cli.main(['inspect', {str(good)!r}]) == 0\n"
            "from attncal import CalibrationConfig\n"
            "from attncal.calibration import ResolvedCalibration\n"
            "from attncal.graphs import DOMAIN\n"
            "CalibrationConfig(pooling='mean').resolve()\n"
            "print(sorted(m for m in ('torch', 'onnx_ir', 'sympy', 'transformers') if m in sys.modules))\n"
            "import attncal, attncal.calibration as cal, attncal.graphs as g\n"
            "from attncal.calibration import attention_functions, efficient, oracle\n"
            "from attncal.graphs.placements import rewrite\n"
            "assert attncal.apply is cal.apply is efficient.apply and attncal.reference is oracle.reference\n"
            "assert cal.UnsupportedArchitectureError is attention_functions.UnsupportedArchitectureError\n"
            "assert g.insert_calibration is rewrite.insert_calibration and 'insert_calibration' in dir(g)\n"
            "assert issubclass(cal.UnsupportedArchitectureError, ValueError)  # the CLI's USER_ERRORS catch it\n"
            "print('ok')\n")
    out = _fresh_python(code)
    assert out.split("\n")[:2] == ["[]", "ok"], out
