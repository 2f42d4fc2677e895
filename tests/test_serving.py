"""Triton serving: repository generation, a real server (the pytriton-bundled tritonserver),
parity over HTTP and gRPC, load, faults, restart, and the `serve` CLI.

Server tests need the serving env (.venv-triton, see attncal/serving/env.py); they are
skipped with the reason when it is missing, unless ATTNCAL_REQUIRE_SERVING=1 (set by
`make test`), which turns the skip into a failure.  Servers bind 127.0.0.1 on free ports
and are stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from attncal.serving import pbtxt
from attncal.serving.env import ServingEnvError, check_env
from attncal.serving.repository import RepoOptions, build_repository, discover
from attncal.serving.server import TritonServer, diagnose, free_port
from support.built_once import built_once
from support.hooks import wait_until

tritonclient = pytest.importorskip("tritonclient")
import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

MAX_LEN = 64
MAX_BATCH = 16
# The "held" model's dynamic batcher waits this long for a preferred batch (4, 8 or 16 requests): 4 requests
# sent at once are one batch of 4 unless one of them is this late, so its batching does not depend on timing.
HOLD_US = 30_000_000
TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


def _env_or_skip():
    try:
        return check_env()
    except ServingEnvError as exc:
        if os.environ.get("ATTNCAL_REQUIRE_SERVING") == "1":
            pytest.fail(f"serving env required but unusable: {exc}")
        pytest.skip(f"serving env unavailable: {exc}")


def _build_exports(root: Path) -> None:
    from attncal.calibration.config import CalibrationConfig
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.synthetic import save_synthetic_model

    model = save_synthetic_model("bert", root / "m", seed=3, max_positions=128, max_seq_length=MAX_LEN)
    export(str(model), root / "cal", ExportOptions(config=CalibrationConfig(basket_size=4, strength=1.0),
                                                   exporter="torchscript", check=False, chunk_vectors=True),
           quiet=True)
    export(str(model), root / "raw", ExportOptions(calibrate=False, exporter="torchscript", check=False), quiet=True)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The calibrated and the uncalibrated export of one tiny BERT (and its model directory, `root`/m), built
    once per run for this module and the others that serve them (support.built_once): read-only.  The calibrated
    one has chunk vectors (--chunk-vectors), so its served encoder takes chunk spans too."""
    root = built_once(tmp_path_factory, "serving-exports", _build_exports)
    return {"cal": root / "cal", "raw": root / "raw", "root": root}


@pytest.fixture(scope="module")
def encoders(exports):
    from attncal.runtime.encoder import Encoder

    return {n: Encoder(exports[n], providers=["CPUExecutionProvider"]) for n in ("cal", "raw")}


@pytest.fixture(scope="module")
def repo(exports, tmp_path_factory):
    path = tmp_path_factory.mktemp("serving") / "repo"
    build_repository(exports["cal"], path, RepoOptions(name="cal", max_batch=MAX_BATCH, max_queue_delay_us=5000))
    build_repository(exports["raw"], path, RepoOptions(name="raw", max_batch=MAX_BATCH, max_queue_delay_us=5000))
    build_repository(exports["cal"], path, RepoOptions(name="held", max_batch=MAX_BATCH, max_queue_delay_us=HOLD_US))
    return path


@pytest.fixture(scope="module")
def server(repo):
    _env_or_skip()
    s = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    s.start()
    try:
        s.wait_ready(150)
        yield s
    finally:
        s.stop()


TEXTS = ["a", "hello world", "the quick brown fox jumps over the lazy dog",
         "calibrated attention " * 5, "naïve café — 東京 ✓"]


def _http_embed(url, model, texts, timeout=20.0):
    c = httpclient.InferenceServerClient(url, connection_timeout=timeout, network_timeout=timeout)
    try:
        arr = np.array([[t.encode() if isinstance(t, str) else t] for t in texts], dtype=object)
        inp = httpclient.InferInput("text", list(arr.shape), "BYTES")
        inp.set_data_from_numpy(arr)
        return c.infer(model, [inp]).as_numpy("sentence_embedding")
    finally:
        c.close()


def _grpc_infer(url, model, arr, datatype="BYTES", timeout=20.0):
    c = grpcclient.InferenceServerClient(url)
    try:
        inp = grpcclient.InferInput("text", list(arr.shape), datatype)
        inp.set_data_from_numpy(arr)
        return c.infer(model, [inp], client_timeout=timeout).as_numpy("sentence_embedding")
    finally:
        c.close()


def _grpc_embed(url, model, texts, timeout=20.0):
    return _grpc_infer(url, model, np.array([[t.encode()] for t in texts], dtype=object), timeout=timeout)


# -- repository generation (no server) ------------------------------------------------------------

def _configs(path: Path) -> dict:
    return {p.parent.name: pbtxt.validate(p.read_text(), required=True) for p in path.glob("*/config.pbtxt")}


def test_repository_configs_follow_triton_schema(exports, tmp_path):
    from google.protobuf.json_format import MessageToDict

    lib = "/opt/attncal/libattncal_ort.so"
    build_repository(exports["cal"], tmp_path / "py", RepoOptions(name="e", instances=2))
    build_repository(exports["cal"], tmp_path / "ort", RepoOptions(name="e", backend="onnxruntime",
                                                                   custom_op_library=lib, kind="gpu"))
    build_repository(exports["cal"], tmp_path / "trt", RepoOptions(name="e", backend="tensorrt", kind="gpu"))
    for variant, platform in (("py", None), ("ort", "onnxruntime_onnx"), ("trt", "tensorrt_plan")):
        cfgs = _configs(tmp_path / variant)
        assert set(cfgs) == {"e", "e-tokenizer", "e-encoder"}
        enc, tok, ens = cfgs["e-encoder"], cfgs["e-tokenizer"], cfgs["e"]
        if platform is None:
            assert enc.backend == "python" and (tmp_path / variant / "e-encoder/1/model.py").exists()
            assert (tmp_path / variant / "e-encoder/1/attncal_precision.py").exists()  # the `dimensions` parameter
            params = {k: v.string_value for k, v in enc.parameters.items()}
            assert params["normalize"] == "1" and params["chunk_vectors"] == "chunk_embeddings"
            assert all(i.allow_ragged_batch for i in enc.input)
            assert enc.instance_group[0].count == 2 and enc.instance_group[0].kind == enc.instance_group[0].KIND_CPU
        else:
            assert enc.platform == platform and not any(i.allow_ragged_batch for i in enc.input)
            assert enc.instance_group[0].kind == enc.instance_group[0].KIND_GPU
        assert enc.max_batch_size == 64 and list(enc.dynamic_batching.preferred_batch_size) == [16, 32, 64]
        assert enc.dynamic_batching.max_queue_delay_microseconds > 0
        assert [i.name for i in enc.input][:3] == ["input_ids", "attention_mask", "token_type_ids"]
        assert enc.output[0].name == "sentence_embedding" and list(enc.output[0].dims) == [32]
        if platform == "tensorrt_plan":  # the chunk vectors are served by the ONNX Runtime encoders only
            assert len(enc.input) == 3 and len(enc.output) == 1
        else:  # the export's chunk vectors: an optional input the ensemble does not feed, and an output
            assert [(i.name, list(i.dims), i.optional) for i in enc.input[3:]] == [("chunk_spans", [-1, 2], True)]
            assert [(o.name, list(o.dims)) for o in enc.output[1:]] == [("chunk_embeddings", [-1, 32])]
        # the ensemble wires text -> tokenizer -> encoder with matching names
        steps = ens.ensemble_scheduling.step
        assert ens.platform == "ensemble" and [s.model_name for s in steps] == ["e-tokenizer", "e-encoder"]
        assert set(steps[0].output_map) == {i.name for i in enc.input if not i.optional} == {o.name for o in tok.output}
        assert set(steps[0].output_map.values()) == set(steps[1].input_map.values())
        from tritonclient.grpc import model_config_pb2 as mc
        assert ens.input[0].data_type == mc.TYPE_STRING and tok.input[0].name == "text"
        params = {k: v.string_value for k, v in tok.parameters.items()}
        assert params["max_length"] == str(MAX_LEN) and params["padding_side"] == "right"
        assert params["padding"] == ("longest" if platform is None else "max_length")
        assert (tmp_path / variant / "e-tokenizer/1/tokenizer/tokenizer.json").exists()
        assert MessageToDict(ens)  # round-trips
    ort = _configs(tmp_path / "ort")["e-encoder"]
    assert list(ort.model_operations.op_library_filename) == [lib]
    assert (tmp_path / "ort/e-encoder/1/model.onnx").exists()
    assert "plugins=" in (tmp_path / "trt/e-encoder/README.txt").read_text()
    assert _configs(tmp_path / "trt")["e-encoder"].default_model_filename == "model.plan"


def test_repository_side_by_side_and_input_errors(exports, tmp_path):
    repo = tmp_path / "r"
    build_repository(exports["cal"], repo, RepoOptions(name="cal"))
    before = (repo / "cal-encoder/config.pbtxt").read_text()
    build_repository(exports["raw"], repo, RepoOptions(name="raw"))
    assert discover(repo) == {"cal": True, "raw": False}
    assert (repo / "cal-encoder/config.pbtxt").read_text() == before
    with pytest.raises(FileExistsError, match="already holds cal"):
        build_repository(exports["raw"], repo, RepoOptions(name="cal"))
    assert discover(repo) == {"cal": True, "raw": False}  # untouched by the refused write
    build_repository(exports["raw"], repo, RepoOptions(name="cal", overwrite=True))
    assert discover(repo) == {"cal": False, "raw": False}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
    with pytest.raises(FileNotFoundError, match="not an attncal export"):
        build_repository(exports["root"] / "m", repo, RepoOptions(name="x"))
    with pytest.raises(ValueError, match="model name"):
        build_repository(exports["cal"], repo, RepoOptions(name="bad name"))
    with pytest.raises(ValueError, match="GPU only"):
        build_repository(exports["cal"], repo, RepoOptions(name="t", backend="tensorrt"))
    with pytest.raises(ValueError, match="invalid Triton model config"):
        pbtxt.validate('name: "x"\nbackend: "python"\nmax_batch_sise: 4\n', required=True)


def test_triton_repo_cli(exports, tmp_path, capsys):
    from attncal.cli import triton_repo

    p = argparse.ArgumentParser()
    triton_repo.add_arguments(p)
    args = p.parse_args([str(exports["cal"]), "-o", str(tmp_path / "r"), "--name", "c", "--no-tokenizer",
                         "--backend", "onnxruntime", "--max-batch", "8"])
    assert triton_repo.run(args) == 0
    assert sorted(x.name for x in (tmp_path / "r").iterdir()) == ["c-encoder"]
    assert "c-encoder" in capsys.readouterr().out
    assert _configs(tmp_path / "r")["c-encoder"].max_batch_size == 8


def _encoder_params(repo: Path, name: str = "e") -> dict:
    return {k: v.string_value for k, v in _configs(repo)[f"{name}-encoder"].parameters.items()}


def test_repository_native_library_by_default(exports, tmp_path, monkeypatch):
    """The encoder references the attncal library built here (python and onnxruntime backends),
    not when it is turned off or absent; an explicit path is required, an auto-found one is not."""
    built = tmp_path / "build"
    built.mkdir()
    (built / "libattncal_ort.so").write_bytes(b"stand-in")
    monkeypatch.delenv("ATTNCAL_ORT_LIBRARY", raising=False)
    monkeypatch.delenv("ATTNCAL_NATIVE", raising=False)
    monkeypatch.setenv("ATTNCAL_PLUGIN_BUILD_DIR", str(built))
    lib = str((built / "libattncal_ort.so").resolve())
    build_repository(exports["cal"], tmp_path / "py", RepoOptions(name="e"))
    assert _encoder_params(tmp_path / "py")["custom_op_library"] == lib
    assert _encoder_params(tmp_path / "py")["custom_op_library_required"] == "0"
    # the model's session keeps ORT's memory pattern as the Encoder does for this short export (256 tokens)
    assert _encoder_params(tmp_path / "py")["memory_pattern"] == "1"
    build_repository(exports["cal"], tmp_path / "ort", RepoOptions(name="e", backend="onnxruntime"))
    assert list(_configs(tmp_path / "ort")["e-encoder"].model_operations.op_library_filename) == [lib]
    build_repository(exports["cal"], tmp_path / "off", RepoOptions(name="e", native=False))
    assert "custom_op_library" not in _encoder_params(tmp_path / "off")
    monkeypatch.setenv("ATTNCAL_NATIVE", "0")
    build_repository(exports["cal"], tmp_path / "env-off", RepoOptions(name="e", backend="onnxruntime"))
    assert not _configs(tmp_path / "env-off")["e-encoder"].model_operations.op_library_filename
    build_repository(exports["cal"], tmp_path / "explicit", RepoOptions(name="e", custom_op_library="/x/lib.so"))
    assert _encoder_params(tmp_path / "explicit")["custom_op_library_required"] == "1"
    monkeypatch.delenv("ATTNCAL_NATIVE")
    monkeypatch.setenv("ATTNCAL_PLUGIN_BUILD_DIR", str(tmp_path / "nothing-built"))
    build_repository(exports["cal"], tmp_path / "none", RepoOptions(name="e"))
    assert "custom_op_library" not in _encoder_params(tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="nothing-built"):
        build_repository(exports["cal"], tmp_path / "req", RepoOptions(name="e", native=True))
    assert not (tmp_path / "req").exists()


def test_repository_prefers_optimized_graph(exports, tmp_path):
    """onnx/model_optimized.onnx, when an export has it, is what the ORT-based encoders serve;
    the tensorrt variant keeps the standard graph."""
    import shutil

    import onnx

    exp = tmp_path / "exp"
    shutil.copytree(exports["cal"], exp)
    marked = onnx.load(str(exp / "onnx/model.onnx"))
    marked.doc_string = "optimized stand-in"
    onnx.save(marked, str(exp / "onnx/model_optimized.onnx"))
    for backend, kind, path in (("python", "cpu", "e-encoder/1/model.onnx"),
                                ("onnxruntime", "cpu", "e-encoder/1/model.onnx"),
                                ("tensorrt", "gpu", "e-encoder/model.onnx")):
        build_repository(exp, tmp_path / backend, RepoOptions(name="e", backend=backend, kind=kind, native=False))
        doc = onnx.load(str(tmp_path / backend / path)).doc_string
        assert (doc == "optimized stand-in") == (backend != "tensorrt"), backend


def test_python_encoder_model_library_policy(tmp_path, monkeypatch, capsys):
    """The Triton Python model registers the library when present, falls back with a notice when an
    auto-found library is missing or ATTNCAL_NATIVE=0, and fails when an explicit one is missing."""
    import importlib.util
    import types

    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    spec = importlib.util.spec_from_file_location(
        "attncal_encoder_model", ROOT / "attncal/serving/models/encoder_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    registered = []

    class SO:
        def register_custom_ops_library(self, path):
            if not os.path.isfile(path):
                raise RuntimeError(f"cannot load {path}")
            registered.append(path)

    lib = tmp_path / "lib.so"
    lib.write_bytes(b"x")
    reg = mod.TritonPythonModel._register_library
    monkeypatch.delenv("ATTNCAL_NATIVE", raising=False)
    assert reg(SO(), {}) is None
    assert reg(SO(), {"custom_op_library": str(lib), "custom_op_library_required": "0"}) == str(lib)
    assert reg(SO(), {"custom_op_library": str(tmp_path / "gone.so"), "custom_op_library_required": "0"}) is None
    assert "function body" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="gone.so"):
        reg(SO(), {"custom_op_library": str(tmp_path / "gone.so"), "custom_op_library_required": "1"})
    monkeypatch.setenv("ATTNCAL_NATIVE", "off")
    assert reg(SO(), {"custom_op_library": str(lib), "custom_op_library_required": "0"}) is None
    assert reg(SO(), {"custom_op_library": str(lib)}) == str(lib)
    assert registered == [str(lib), str(lib)]


def _fake_tritonserver(tmp_path, name: str, body: str) -> Path:
    exe = tmp_path / name
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return exe


def test_temporary_log_dropped_after_clean_stop_kept_otherwise(repo, tmp_path):
    """Benchmarks and tests start hundreds of servers: their temporary logs must not pile up in /tmp."""
    ready = tmp_path / "ready"
    # It exits 0 on SIGTERM, as tritonserver does; `ready` appears once the trap is set.
    clean = _fake_tritonserver(tmp_path, "clean", f"trap 'exit 0' TERM; touch '{ready}'; while :; do sleep 0.05; done")

    def wait_ready() -> None:
        wait_until(ready.exists, 60, "the fake server to start")
        ready.unlink()

    ports = dict(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    for keep in (False, True):
        s = TritonServer(repo, tritonserver=clean, keep_log=keep, **ports).start()
        log = s.log_file
        assert log is not None and log.is_file()
        wait_ready()
        assert s.stop(timeout_s=10) == 0
        assert log.exists() == keep, f"keep_log={keep}"
        log.unlink(missing_ok=True)
    # A server that failed keeps its log: the error names it.
    failing = _fake_tritonserver(tmp_path, "failing", "echo E boom; exit 0")
    s = TritonServer(repo, tritonserver=failing, **ports).start()
    with pytest.raises(Exception, match="before it was ready") as info:
        s.wait_ready(20)
    s.stop()
    assert s.log_file.is_file() and str(s.log_file) in str(info.value)
    assert "boom" in s.log_text()
    s.log_file.unlink()
    # An explicit log file is the user's: never removed.
    mine = tmp_path / "mine.log"
    s = TritonServer(repo, tritonserver=clean, log_file=mine, **ports).start()
    wait_ready()
    assert s.stop(timeout_s=10) == 0 and mine.is_file()


def test_env_problems_are_named(tmp_path):
    with pytest.raises(ServingEnvError, match="no serving environment"):
        check_env(tmp_path / "nowhere")
    if (ROOT / ".venv/bin/python").exists():  # the main env: numpy 2 and no pytriton
        with pytest.raises(ServingEnvError, match="lacks nvidia-pytriton"):
            check_env(ROOT / ".venv")
    assert "numpy < 2" in diagnose("E1129 pb_stub.cc] output tensor shape does not match")
    assert "libpython" in diagnose("Fatal Python error: init_fs_encoding\nNo module named 'encodings'")


# -- the real server ---------------------------------------------------------------------------------

def test_parity_http_and_grpc(server, encoders):
    long_text = "x" * (MAX_LEN * 40)  # far beyond max length: truncated, as the source model does
    texts = TEXTS + [long_text]
    got = {}
    for name in ("cal", "raw"):
        ref = encoders[name].encode(texts)
        for proto, fn, url in (("http", _http_embed, server.http_url), ("grpc", _grpc_embed, server.grpc_url)):
            emb = fn(url, name, texts)
            assert emb.shape == ref.shape and emb.dtype == np.float32
            assert np.abs(emb - ref).max() <= TOL, (name, proto, np.abs(emb - ref).max())
            got[name] = emb
    assert np.abs(got["cal"] - got["raw"]).max() > 1e-3  # the calibrated model is the one served


def test_load_dynamic_batching(server, encoders):
    from attncal.synthetic import synthetic_text

    pool = [synthetic_text(n, seed=n) for n in range(5, 200, 6)]
    expected = {n: encoders[n].encode(pool) for n in ("cal", "raw")}
    clients, per_client = 16, 50
    errors: list[str] = []
    wrong: list[float] = []
    done = [0] * clients
    barrier = threading.Barrier(clients)

    def worker(k: int) -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            barrier.wait(timeout=30)
            for r in range(per_client):
                name = "cal" if (k + r) % 2 else "raw"
                i = (k * 7 + r * 3) % len(pool)
                arr = np.array([[pool[i].encode()]], dtype=object)
                inp = grpcclient.InferInput("text", [1, 1], "BYTES")
                inp.set_data_from_numpy(arr)
                try:
                    emb = c.infer(name, [inp], client_timeout=30).as_numpy("sentence_embedding")[0]
                except InferenceServerException as exc:
                    errors.append(str(exc))
                    continue
                err = float(np.abs(emb - expected[name][i]).max())
                if err > TOL:
                    wrong.append(err)
                done[k] += 1
        finally:
            c.close()

    before = {m: _inference_stats(server, m) for m in ("cal-encoder", "raw-encoder")}
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    elapsed = time.monotonic() - t0
    assert not any(t.is_alive() for t in threads), "load clients did not finish in time"
    assert errors == [] and wrong == []
    assert sum(done) == clients * per_client
    sent = {"cal-encoder": sum(1 for k in range(clients) for r in range(per_client) if (k + r) % 2),
            "raw-encoder": sum(1 for k in range(clients) for r in range(per_client) if not (k + r) % 2)}
    sizes = {}
    for m, (requests, batches) in before.items():
        after_requests, after_batches = _inference_stats(server, m)
        sizes[m] = {size: n - batches.get(size, 0) for size, n in after_batches.items() if n > batches.get(size, 0)}
        # The server's own account: every request ran once, in batches of at most MAX_BATCH (how many it
        # batched together depends on the scheduler; test_dynamic_batcher_batches_queued_requests decides that).
        assert after_requests - requests == sent[m], (m, after_requests - requests, sent[m])
        assert sum(size * n for size, n in sizes[m].items()) == sent[m], (m, sizes[m])
        assert max(sizes[m]) <= MAX_BATCH, (m, sizes[m])
    print(f"\nload: {sum(done)} requests in {elapsed:.1f} s ({sum(done) / elapsed:.0f} req/s); "
          f"encoder batch sizes {sizes}")


def _inference_stats(server, model: str) -> tuple[int, dict[int, int]]:
    """(requests the server has run on `model`, {batch size: executions of that size}) from its statistics."""
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        stats = c.get_inference_statistics(model_name=model, as_json=True)["model_stats"][0]
    finally:
        c.close()
    return (int(stats.get("inference_count", 0)),
            {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in stats.get("batch_stats", [])})


def test_dynamic_batcher_batches_queued_requests(server, encoders):
    """Four requests sent at once to the "held" model, whose batcher waits HOLD_US for a preferred batch of 4:
    the server's statistics show them run as one batch of 4, each answer the Encoder's."""
    texts = [f"request {k}: " + "word " * (3 + 5 * k) for k in range(4)]
    expected = encoders["cal"].encode(texts)
    _, before = _inference_stats(server, "held-encoder")
    barrier = threading.Barrier(len(texts))
    got: dict[int, np.ndarray] = {}

    def send(k: int) -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            inp = grpcclient.InferInput("text", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[texts[k].encode()]], dtype=object))
            barrier.wait(timeout=30)
            got[k] = c.infer("held", [inp], client_timeout=2 * HOLD_US / 1e6).as_numpy("sentence_embedding")[0]
        finally:
            c.close()

    threads = [threading.Thread(target=send, args=(k,), daemon=True) for k in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * HOLD_US / 1e6 + 30)
    assert sorted(got) == list(range(len(texts)))
    for k, emb in got.items():
        assert np.abs(emb - expected[k]).max() <= TOL
    _, after = _inference_stats(server, "held-encoder")
    new = {size: n - before.get(size, 0) for size, n in after.items() if n > before.get(size, 0)}
    assert new == {4: 1}, f"the held model ran {new} (batch size: executions), not one batch of 4"


def test_faults_get_errors_and_server_keeps_serving(server, encoders):
    url = server.grpc_url
    good = encoders["cal"].encode(["still fine"])

    def still_serving():
        assert np.abs(_grpc_embed(url, "cal", ["still fine"]) - good).max() <= TOL

    faults = {
        "wrong dtype": lambda: _grpc_infer(url, "cal", np.array([[1], [2]], dtype=np.int32), datatype="INT32"),
        "wrong shape": lambda: _grpc_infer(url, "cal", np.array([[b"a", b"b"]], dtype=object)),
        "empty batch": lambda: _grpc_infer(url, "cal", np.zeros((0, 1), dtype=object)),
        "empty string": lambda: _grpc_embed(url, "cal", ["ok", ""]),
        "non-UTF-8": lambda: _grpc_infer(url, "cal", np.array([[b"ok"], [b"\xff\xfe\x80"]], dtype=object)),
        "batch above max": lambda: _grpc_embed(url, "cal", ["t"] * (MAX_BATCH + 1)),
        "http non-UTF-8": lambda: _http_embed(server.http_url, "cal", [b"\xc3\x28"]),
    }
    messages = {}
    for what, call in faults.items():
        with pytest.raises(InferenceServerException) as info:
            call()
        messages[what] = str(info.value)
        still_serving()
    assert "UTF-8" in messages["non-UTF-8"] and "empty" in messages["empty string"]
    # far beyond max length is not a fault: truncated exactly like the local encoder
    long_text = "y " * 5000
    assert np.abs(_grpc_embed(url, "cal", [long_text]) - encoders["cal"].encode([long_text])).max() <= TOL
    assert server.running()


# -- `attncal serve`, kill and restart ------------------------------------------------------------------

def _serve_cmd(repo, ports):
    """`attncal serve` where neither torch nor transformers can be imported, as in the runtime install (a None
    entry in sys.modules makes their import fail): serving needs neither; Triton runs in its own environment."""
    code = ("import sys, argparse\nsys.modules['torch'] = sys.modules['transformers'] = None\n"
            "from attncal.cli import CLIError, serve\np = argparse.ArgumentParser()\n"
            "serve.add_arguments(p)\ntry:\n    sys.exit(serve.run(p.parse_args(sys.argv[1:])))\n"
            "except CLIError as e:\n    print(f'error: {e}', flush=True)\n    sys.exit(e.code)\n")
    return [sys.executable, "-c", code, str(repo), "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
            "--metrics-port", str(ports[2]), "--ready-timeout", "120"]


def _start_cli(repo, ports):
    """`attncal serve` started, once it has printed its ready line and the model list after it (or ended)."""
    proc = subprocess.Popen(_serve_cmd(repo, ports), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    lines: list[str] = []
    n_models = len(list(Path(repo).glob("*/config.pbtxt")))
    listed = threading.Event()  # the ready line and every model's line after it were read, or the output ended

    def reader():
        models = None
        for line in proc.stdout:
            lines.append(line)
            if models is None and "ready:" in line:
                models = 0
            elif models is not None and re.match(r"^  \S+ v\S+ \S+$", line):
                models += 1
            if models == n_models:
                listed.set()
        listed.set()

    threading.Thread(target=reader, daemon=True).start()
    if not listed.wait(150) or not any("ready:" in x for x in lines):
        proc.kill()
        pytest.fail("attncal serve did not become ready: " + "".join(lines[-20:]))
    pid = int(re.search(r"tritonserver \(pid (\d+)", "".join(lines)).group(1))
    return proc, pid, lines


def _group_gone(pgid: int) -> bool:
    """Whether no process is left in group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_serve_cli_kill_restart_and_sigterm(exports, encoders, tmp_path):
    _env_or_skip()
    repo = tmp_path / "r"
    build_repository(exports["raw"], repo, RepoOptions(name="raw", max_batch=MAX_BATCH))
    ports = (free_port(), free_port(), free_port())
    url = f"127.0.0.1:{ports[1]}"
    proc, pid, lines = _start_cli(repo, ports)
    try:
        text = "".join(lines)
        assert "raw-encoder v1 READY" in text and "raw-tokenizer v1 READY" in text and "127.0.0.1" in text
        ref = encoders["raw"].encode(["restart me"])
        # The clients send until told to stop; the server is killed once they have seen KILL_AFTER_OKS answers
        # (mid-load: they are still sending), and they are stopped once every client has seen an error.  What
        # each error says, not how long it took, shows there was no hang: a dead server's connection is refused
        # or reset (UNAVAILABLE), where a hung one would leave the client to its own timeout (DEADLINE_EXCEEDED).
        KILL_AFTER_OKS, DEADLINE_S, n_clients = 20, 60.0, 4
        outcomes: list[tuple[int, str]] = []  # (client, "ok" or the error's gRPC status)
        stop = threading.Event()

        def _inp(texts):
            arr = np.array([[t.encode()] for t in texts], dtype=object)
            i = grpcclient.InferInput("text", list(arr.shape), "BYTES")
            i.set_data_from_numpy(arr)
            return i

        def loader(k: int):
            c = grpcclient.InferenceServerClient(url)
            try:
                while not stop.is_set():
                    try:
                        c.infer("raw", [_inp(["restart me"])], client_timeout=5)
                        outcomes.append((k, "ok"))
                    except InferenceServerException as exc:
                        outcomes.append((k, str(exc.status())))
                        stop.wait(0.05)
            finally:
                c.close()

        threads = [threading.Thread(target=loader, args=(k,), daemon=True) for k in range(n_clients)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: sum(o == "ok" for _, o in outcomes) >= KILL_AFTER_OKS, DEADLINE_S,
                       f"the clients to see {KILL_AFTER_OKS} answers")
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: {k for k, o in outcomes if o != "ok"} == set(range(n_clients)), DEADLINE_S,
                       "every client to see the dead server")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a client hung after the server died"
        errors = {o for _, o in outcomes if o != "ok"}
        assert errors and "StatusCode.DEADLINE_EXCEEDED" not in errors, errors  # clean errors, no hang
        assert proc.wait(timeout=30) == 1  # the CLI notices the server died
        assert "exited unexpectedly" in "".join(lines)
        wait_until(lambda: _group_gone(pid), 10, "the killed server's Python stubs to end")

        proc, pid, lines = _start_cli(repo, ports)  # restart on the same ports
        assert np.abs(_grpc_embed(url, "raw", ["restart me"]) - ref).max() <= TOL
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        out = "".join(lines)
        assert "stopped (tritonserver status 0)" in out
        wait_until(lambda: _group_gone(pid), 10, "the stopped server's Python stubs to end")
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_bench_triton_smoke(server):
    from attncal.serving.bench import bench_triton, format_table

    res = bench_triton(server.grpc_url, ["cal", "raw"], baseline="raw", concurrency=(1, 4),
                       requests_per_client=5, rounds=2, warmup=2, show_progress=False)
    assert {(r["model"], r["concurrency"]) for r in res["rows"]} == {(m, c) for m in ("cal", "raw") for c in (1, 4)}
    assert all(r["errors"] == 0 and r["seq_per_s"] > 0 and r["p95_ms"] >= r["p50_ms"] > 0 for r in res["rows"])
    assert len(res["ratios"]) == 2 and "throughput" in format_table(res)
    # --requests: every level gets the same number of requests, shared by its clients.
    res = bench_triton(server.grpc_url, ["raw"], concurrency=(1, 4), requests_per_level=8, rounds=1, warmup=1,
                       show_progress=False)
    assert res["requests_per_client"] == {1: 8, 4: 2} and all(r["errors"] == 0 for r in res["rows"])
