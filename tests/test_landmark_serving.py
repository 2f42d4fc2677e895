"""Landmark pooling served by a real Triton server (the serving env, as tests/test_serving.py runs it): the served
tokenizer model places the landmarks as `Encoder` does, and the ensemble's embeddings equal the Encoder's bit for
bit on the same batch."""

from __future__ import annotations

import numpy as np
import pytest

from test_serving import _env_or_skip, _http_embed  # noqa: E402 - the serving tests' helpers

tritonclient = pytest.importorskip("tritonclient")
import tritonclient.http as httpclient  # noqa: E402

MAX_LEN = 48
TEXTS = ["a", "One sentence. And [SEP] spelled out, then another one!", "naïve café — 東京 ✓ " * 3,
         "position bias in long passages " * 12]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    _env_or_skip()
    from attncal.exporting.exporter import ExportOptions, export
    from attncal.runtime.encoder import Encoder
    from attncal.calibration.config import CalibrationConfig
    from attncal.pooling import Pooling
    from attncal.serving.repository import RepoOptions, build_repository
    from attncal.serving.server import TritonServer, free_port
    from attncal.synthetic import save_synthetic_model

    root = tmp_path_factory.mktemp("lmk-serving")
    src = save_synthetic_model("bert", root / "src", seed=6, max_positions=64, max_seq_length=MAX_LEN)
    export(str(src), root / "lmk", ExportOptions(config=CalibrationConfig(pooling=Pooling("lmk", 8)), calibrate=False,
                                                 exporter="torchscript", optimized=False, check=False), quiet=True)
    build_repository(root / "lmk", root / "repo", RepoOptions(name="lmk", max_batch=8, max_queue_delay_us=0))
    server = TritonServer(root / "repo", http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server.start()
    try:
        server.wait_ready(150)
        yield server, Encoder(root / "lmk", providers=["CPUExecutionProvider"])
    finally:
        server.stop()


def test_served_landmarks_and_embeddings_equal_the_encoder(served):
    server, enc = served
    c = httpclient.InferenceServerClient(server.http_url, connection_timeout=20, network_timeout=20)
    try:
        arr = np.array([[t.encode()] for t in TEXTS], dtype=object)
        inp = httpclient.InferInput("text", list(arr.shape), "BYTES")
        inp.set_data_from_numpy(arr)
        tokens = c.infer("lmk-tokenizer", [inp])
    finally:
        c.close()
    want = enc.tokenize(TEXTS)
    assert (want["input_ids"] == enc.pooling.token_id).sum() > len(TEXTS)  # landmarks beyond the final SEPs
    for name in ("input_ids", "attention_mask"):
        assert np.array_equal(tokens.as_numpy(name), want[name]), name
    got = _http_embed(server.http_url, "lmk", TEXTS)
    ref = enc.encode(TEXTS, batch_size=len(TEXTS), sort_by_length=False)
    assert got.dtype == np.float32 and np.array_equal(got, ref), np.abs(got - ref).max()
