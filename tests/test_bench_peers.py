"""The peers of `attncal bench`: openvino, openvino-cal and torch-sdpa, each in a process of its own during
the timed rounds, peak memory probed like every engine (no timing assertions)."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from attncal import CalibrationConfig
from attncal.artifact import INLINED_GRAPH
from attncal.bench.engines import OWN_PROCESS, EngineUnavailable, OwnProcessEngine, Workspace, make_engine, make_feeds
from attncal.cli import main
from attncal.runtime.encoder import Encoder
from attncal.synthetic import save_synthetic_model

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
PEERS = ["openvino", "openvino-cal", "torch-sdpa"] if HAS_OPENVINO else ["torch-sdpa"]


@pytest.fixture(scope="module")
def peer_bench(tmp_path_factory, shared_raw_exports):
    """One `attncal bench` run of the peers beside `ort` on a tiny mean-pooled BERT (fused-softmax calibration
    on the portable graph, inlined for openvino-cal; strength 1 in every layer with small baskets, so that it
    moves this random model's embeddings): its results and its workspace.  Its exports share one torch.onnx
    export (conftest's `shared_raw_exports`): the peers are the subject."""
    root = tmp_path_factory.mktemp("peers")
    model = save_synthetic_model("bert", root / "model", seed=1, max_positions=128, pooling="mean")
    out, work = root / "results", root / "work"
    code = main(["bench", str(model), "--engines", ",".join(["ort", *PEERS]), "--seq", "24", "--batch", "2",
                 "--repeats", "2", "--memory-probes", "1", "--threads", "1", "--basket-size", "4", "--strength", "1",
                 "--layers", "all", "--out", str(out),
                 "--workdir", str(work)])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    exports, = work.iterdir()  # one workspace: this model, config and code
    return data, Workspace(model, CalibrationConfig.from_dict(data["meta"]["config"]), exports, 1)


def test_peers_run_and_are_probed_for_peak_memory(peer_bench):
    data, _ = peer_bench
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"ort", *PEERS} and not data["notes"]
    for r in rows.values():
        assert r["p50_ms"] > 0 and r["peak_mib"] is not None and len(r["peak_mib_probes"]) == 1
        assert r["latency_vs_peer"] == pytest.approx(r["p50_ms"] / rows["ort"]["p50_ms"])


def test_own_process_engines_compute_what_the_exports_compute(peer_bench):
    """Each peer's process runs the engine it names: its embeddings (computed in this process by the same
    `make_engine`) match ONNX Runtime on the export it runs, at fp32 parity."""
    _, ws = peer_bench
    feeds = make_feeds(2, 24, 128, seed=3)
    expected = {"uncal": Encoder(ws.export_dir("uncal"), graph="portable").run(feeds)[1]}
    if HAS_OPENVINO:
        expected["inlined"] = Encoder(ws.export_dir("inlined"), graph="inlined").run(feeds)[1]
    got = {"openvino": ("uncal", make_engine("openvino", ws) if HAS_OPENVINO else None),
           "openvino-cal": ("inlined", make_engine("openvino-cal", ws) if HAS_OPENVINO else None),
           "torch-sdpa": ("uncal", make_engine("torch-sdpa", ws))}
    for name, (export, run) in got.items():
        if run is None:
            continue
        out = run(feeds)
        emb = out[run.compiled.output("sentence_embedding")] if name.startswith("openvino") else out.numpy()
        assert np.abs(emb - expected[export]).max() <= 1e-5, name
    assert (ws.export_dir("inlined") / INLINED_GRAPH).exists() == HAS_OPENVINO


def test_own_process_engine_runs_elsewhere_reports_failures_and_ends(peer_bench):
    _, ws = peer_bench
    assert set(PEERS) <= set(OWN_PROCESS)
    engine = make_engine("torch-sdpa", ws, own_process=True)
    assert isinstance(engine, OwnProcessEngine) and engine.pid != os.getpid()
    assert engine(make_feeds(1, 8, 128)) is None
    # Planted failure: a batch the model cannot take (token ids beyond its vocabulary) fails in the engine's
    # process and is raised here, with that process's traceback; the process goes on serving.
    bad = make_feeds(1, 8, 128)
    bad["input_ids"][:] = 10**6
    with pytest.raises(RuntimeError, match="(?s)torch-sdpa failed in its process.*IndexError"):
        engine(bad)
    engine(make_feeds(1, 8, 128))
    proc = engine._proc
    engine.close()
    assert proc.poll() is not None
    # An engine that cannot run says why, from its process, as the in-process engines do.
    missing = Workspace(ws.model, ws.config, ws.exports.parent / "none", 1)
    with pytest.raises(EngineUnavailable, match="no onnx/model_inlined.onnx in the export|openvino is not installed"):
        make_engine("openvino-cal", missing, own_process=True)
