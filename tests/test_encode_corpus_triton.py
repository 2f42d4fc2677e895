"""`attncal encode --engine triton` against the real tritonserver, started by test_serving's fixtures
(imported, not copied), and its retry / loud-failure behaviour."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("tritonclient")

from test_serving import encoders, exports, repo, server  # noqa: E402,F401  (fixtures, reused as they are)

from attncal.corpus import encode_corpus, load_manifest, read_embeddings  # noqa: E402
from attncal.corpus.triton import TritonEngine, TritonEngineError  # noqa: E402
from attncal.serving.server import free_port  # noqa: E402
from attncal.synthetic import synthetic_text  # noqa: E402

TOL = 1e-5


def test_triton_engine_matches_encoder(exports, encoders, server, tmp_path):  # noqa: F811
    rng = np.random.default_rng(3)
    texts = [synthetic_text(int(rng.integers(1, 300)), seed=i) for i in range(90)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "out"
    res = encode_corpus(exports["cal"], src, out, engine="triton", url=server.grpc_url, model_name="cal", workers=4,
                        batch_size=8, window=32, shard_size=40, show_progress=False)
    ids, emb = read_embeddings(out)
    assert ids == [f"t{i}" for i in range(90)] and res.tokens is None
    assert [s["rows"] for s in load_manifest(out)["shards"]] == [40, 40, 10]
    assert np.abs(emb - encoders["cal"].encode(texts, batch_size=8)).max() <= TOL
    with pytest.raises(TritonEngineError, match="model 'nope' is not ready"):
        encode_corpus(exports["cal"], src, tmp_path / "o2", engine="triton", url=server.grpc_url, model_name="nope",
                      show_progress=False)
    assert not (tmp_path / "o2").exists()


def test_triton_engine_retries_then_fails_loudly(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr("attncal.corpus.triton.time.sleep", sleeps.append)
    eng = TritonEngine(f"127.0.0.1:{free_port()}", "m", batch_size=4, retries=3, backoff_s=0.5, timeout_s=5)
    with pytest.raises(TritonEngineError, match=r"failed after 4 attempt\(s\) \(persistent transient error\)"):
        eng._infer(["a"])
    assert sleeps == [0.5, 1.0, 2.0]
    with pytest.raises(TritonEngineError, match="not reachable|not ready"):
        eng.check(32)


def test_triton_engine_writes_dimensions_and_precision(exports, encoders, server, tmp_path):  # noqa: F811
    """--dimensions / --precision on the Triton engine: the server truncates (the request parameter `dimensions`)
    and the client quantizes, with the functions `Encoder.output` runs, so the bits equal the Encoder's wherever the
    server's floats and the Encoder's (equal to 1e-5) lie on the same side of a bit's threshold."""
    texts = [synthetic_text(40 + 5 * i, seed=200 + i) for i in range(30)]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    encode_corpus(exports["cal"], src, tmp_path / "out", engine="triton", url=server.grpc_url, model_name="cal",
                  dimensions=16, precision="ubinary", batch_size=8, show_progress=False)
    ids, got = read_embeddings(tmp_path / "out")
    enc = encoders["cal"]
    floats = enc.encode(texts, batch_size=8, dimensions=16)
    want = enc.encode(texts, batch_size=8, dimensions=16, precision="ubinary")
    assert ids == [f"t{i}" for i in range(30)] and got.shape == (30, 2) and got.dtype == np.uint8
    bits = np.unpackbits(got, axis=1) != np.unpackbits(want, axis=1)
    assert not (bits & (np.abs(floats) > 1e-4)).any()


def _corpus(path, texts):
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def test_triton_engine_late_chunks_equal_local_bit_for_bit(exports, server, tmp_path, monkeypatch):  # noqa: F811
    """--chunks late on the triton engine: the export's chunk vectors served by NAME-encoder (token ids and chunk
    spans in, one vector per chunk out), truncated to --dimensions by the server, equal the local engine's rows bit
    for bit; a row that cannot be chunked is skipped by name (--on-error skip); an interrupted run resumed writes
    each chunk row once."""
    from attncal.corpus import shards
    from attncal.corpus.shards import read_output

    texts = [synthetic_text(20 + 37 * i, seed=300 + i) for i in range(11)] + ["[CLS] [SEP]"]
    src = _corpus(tmp_path / "c.jsonl", texts)
    kw = dict(chunks="late", chunk_size=12, chunk_overlap=4, dimensions=16, on_error="skip", batch_size=3, window=4,
              shard_size=4, show_progress=False)
    encode_corpus(exports["cal"], src, tmp_path / "local", **kw)

    def crash(stage, name):
        if stage == "committed" and name == "part-00001.parquet":
            raise KeyboardInterrupt

    served = dict(engine="triton", url=server.grpc_url, model_name="cal", workers=2)
    monkeypatch.setattr(shards, "FAULT_HOOK", crash)
    with pytest.raises(KeyboardInterrupt):
        encode_corpus(exports["cal"], src, tmp_path / "triton", **served, **kw)
    monkeypatch.setattr(shards, "FAULT_HOOK", None)
    assert len(load_manifest(tmp_path / "triton")["shards"]) == 2
    res = encode_corpus(exports["cal"], src, tmp_path / "triton", resume=True, **served, **kw)
    a, b = read_output(tmp_path / "local"), read_output(tmp_path / "triton")
    assert a[0] == b[0] and a[1].shape[1] == 16 and np.array_equal(a[1], b[1])
    assert all(np.array_equal(a[2][k], b[2][k]) for k in a[2]) and b[2]["window"].max() >= 2
    pairs = list(zip(b[0], b[2]["chunk"].tolist()))
    assert len(pairs) == len(set(pairs)) and res.skipped == 1
    skipped = [json.loads(x) for x in (tmp_path / "triton" / "skipped.jsonl").read_text().splitlines()]
    assert [(s["id"], s["stage"]) for s in skipped] == [("t11", "chunking")]
    assert load_manifest(tmp_path / "triton")["engine"]["chunk_model"] == "cal-encoder"


def test_triton_engine_naive_chunks_and_refusals(exports, encoders, server, tmp_path):  # noqa: F811
    """Naive chunks are chunk texts sent to the ensemble (equal to the local engine's to 1e-5, as any text); late
    chunks need a served export with chunk vectors."""
    from attncal.corpus.shards import read_output

    src = _corpus(tmp_path / "c.jsonl", [synthetic_text(40 + 60 * i, seed=400 + i) for i in range(5)])
    kw = dict(chunks="naive", chunk_size=12, chunk_overlap=2, batch_size=4, show_progress=False)
    encode_corpus(exports["cal"], src, tmp_path / "local", **kw)
    encode_corpus(exports["cal"], src, tmp_path / "triton", engine="triton", url=server.grpc_url, model_name="cal",
                  **kw)
    a, b = read_output(tmp_path / "local"), read_output(tmp_path / "triton")
    assert a[0] == b[0] and all(np.array_equal(a[2][k], b[2][k]) for k in a[2])
    assert np.abs(a[1] - b[1]).max() <= TOL
    with pytest.raises(TritonEngineError, match="'raw-encoder' returns no chunk_embeddings: export the model with "
                                                "--chunk-vectors"):
        encode_corpus(exports["raw"], src, tmp_path / "raw", engine="triton", url=server.grpc_url, model_name="raw",
                      chunks="late", show_progress=False)
    assert not (tmp_path / "raw").exists()


def test_triton_dimensions_parameter(exports, encoders, server, tmp_path):  # noqa: F811
    """The request parameter `dimensions`: the server truncates and renormalises as Encoder.encode(dimensions=)
    does, and refuses what the Encoder refuses, with its message."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    texts = [synthetic_text(10 + 9 * i, seed=500 + i) for i in range(6)]
    arr = np.array([[t.encode()] for t in texts], dtype=object)
    c = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        def infer(dims):
            inp = grpcclient.InferInput("text", list(arr.shape), "BYTES")
            inp.set_data_from_numpy(arr)
            return c.infer("cal", [inp], parameters={"dimensions": dims}, client_timeout=20).as_numpy(
                "sentence_embedding")

        got = infer(8)
        assert got.shape == (6, 8) and np.abs(np.linalg.norm(got, axis=1) - 1).max() < 1e-6
        assert np.abs(got - encoders["cal"].encode(texts, dimensions=8)).max() <= TOL
        for bad in (0, 33):
            with pytest.raises(InferenceServerException) as info:
                infer(bad)
            with pytest.raises(ValueError) as local:
                encoders["cal"].encode(texts, dimensions=bad)
            assert str(local.value) in str(info.value)
    finally:
        c.close()
    src = _corpus(tmp_path / "c.jsonl", texts)
    with pytest.raises(ValueError, match=r"dimensions must be in \[1, 32\] \(the model's embedding width\), got 40"):
        encode_corpus(exports["cal"], src, tmp_path / "o", engine="triton", url=server.grpc_url, model_name="cal",
                      dimensions=40, show_progress=False)
    assert not (tmp_path / "o").exists()
